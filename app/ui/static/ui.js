// saker's web page: a playground whose tokens are coloured by their probability, and a live view of /metrics.
// Plain JavaScript, no library, nothing from another host; every URL is relative to the page, so it works under a
// path prefix too. The API key (when the server has keys) lives in this tab's sessionStorage only.
"use strict";

(() => {
  const KEY_STORE = "saker.apiKey";
  const KEEP_S = 900; // the live charts keep 15 minutes and show the last 1, 5 (default) or 15
  const POLL_MS = 1000;

  const $ = (selector, root = document) => root.querySelector(selector);
  const el = {
    model: $("#model"),
    modelsStatus: $("#models-status"),
    key: $("#api-key"),
    forgetKey: $("#forget-key"),
    form: $("#form"),
    completionInput: $("#completion-input"),
    chatInput: $("#chat-input"),
    prompt: $("#prompt"),
    echo: $("#echo"),
    messages: $("#messages"),
    messageTemplate: $("#message-template"),
    addMessage: $("#add-message"),
    keepAnswer: $("#keep-answer"),
    temperature: $("#temperature"),
    topP: $("#top_p"),
    maxTokens: $("#max_tokens"),
    seed: $("#seed"),
    n: $("#n"),
    alternatives: $("#top_k_alts"),
    stop: $("#stop"),
    structured: $("#structured"),
    constraintLabel: $("#constraint-label"),
    constraint: $("#constraint"),
    stream: $("#stream"),
    send: $("#send"),
    stopButton: $("#stop-button"),
    runStatus: $("#run-status"),
    answer: $("#answer"),
    error: $("#error"),
    output: $("#output"),
    info: $("#token-info"),
    timing: $("#timing"),
    liveOn: $("#live-on"),
    liveWindow: $("#live-window"),
    liveStatus: $("#live-status"),
    charts: $("#charts"),
  };

  // -- the API key ------------------------------------------------------------------------------------------------
  const apiKey = () => sessionStorage.getItem(KEY_STORE) || "";

  function headers(json) {
    const result = {};
    if (json) result["Content-Type"] = "application/json";
    const key = apiKey();
    if (key) result.Authorization = "Bearer " + key;
    return result;
  }

  el.key.value = apiKey();
  el.key.addEventListener("change", () => {
    const key = el.key.value.trim();
    if (key) sessionStorage.setItem(KEY_STORE, key);
    else sessionStorage.removeItem(KEY_STORE);
    loadModels();
  });
  el.forgetKey.addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    el.key.value = "";
    loadModels();
  });

  // An error answer's OpenAI body ({"error": {"message", "type", "param", "code"}}), or its text.
  async function readError(response) {
    let text = "";
    try {
      text = await response.text();
    } catch (_) {
      // the body could not be read: the status says enough
    }
    try {
      const body = JSON.parse(text);
      if (body && body.error && typeof body.error.message === "string") return body.error;
    } catch (_) {
      // not JSON
    }
    return { message: text.trim() || response.statusText || "the request failed" };
  }

  function showError(status, error) {
    el.error.replaceChildren();
    const head = document.createElement("strong");
    head.textContent = status ? `${status} ` : "Error ";
    const message = document.createElement("span");
    message.className = "error-message";
    message.textContent = error.message;
    el.error.append(head, message);
    const details = [error.type, error.code, error.param ? `param: ${error.param}` : null].filter(Boolean);
    if (details.length) {
      const small = document.createElement("small");
      small.textContent = ` (${details.join(", ")})`;
      el.error.append(small);
    }
    el.error.hidden = false;
  }

  function clearError() {
    el.error.hidden = true;
    el.error.replaceChildren();
  }

  // -- models -----------------------------------------------------------------------------------------------------
  let modelsRetry = null;

  // the model names; while the server loads its model (503) or cannot be reached, asked again every 3 s
  async function loadModels() {
    clearTimeout(modelsRetry);
    const retry = () => {
      modelsRetry = setTimeout(loadModels, 3000);
    };
    el.modelsStatus.textContent = "Loading the models…";
    try {
      const response = await fetch("v1/models", { headers: headers(false), cache: "no-store" });
      if (!response.ok) {
        const error = await readError(response);
        el.model.replaceChildren(new Option("(the server's default)", ""));
        el.modelsStatus.textContent = `Models: ${response.status} ${error.message}`;
        el.key.classList.toggle("needs-key", response.status === 401);
        if (response.status >= 500) retry();
        return;
      }
      const body = await response.json();
      const previous = el.model.value;
      const ids = body.data.map((card) => card.id);
      el.model.replaceChildren(...ids.map((id) => new Option(id, id)));
      if (ids.includes(previous)) el.model.value = previous;
      el.modelsStatus.textContent = `${ids.length} model name${ids.length === 1 ? "" : "s"} served.`;
      el.key.classList.remove("needs-key");
    } catch (error) {
      el.modelsStatus.textContent = `Cannot reach the server: ${error.message}`;
      retry();
    }
  }

  // -- the form ---------------------------------------------------------------------------------------------------
  const mode = () => el.form.elements.mode.value;

  function showMode() {
    const chat = mode() === "chat";
    el.completionInput.hidden = chat;
    el.chatInput.hidden = !chat;
  }
  for (const radio of el.form.elements.mode) radio.addEventListener("change", showMode);

  function addMessage(role, content) {
    const item = el.messageTemplate.content.firstElementChild.cloneNode(true);
    $(".role", item).value = role;
    $(".content", item).value = content;
    $(".remove", item).addEventListener("click", () => {
      const next = item.nextElementSibling || item.previousElementSibling;
      item.remove();
      if (next) $(".content", next).focus();
      else el.addMessage.focus();
    });
    el.messages.append(item);
    return item;
  }
  addMessage("user", "What is the capital of France?");
  el.addMessage.addEventListener("click", () => $(".content", addMessage("user", "")).focus());

  let lastAnswer = null; // the first choice of the last chat answer, for "add the answer to the messages"
  el.keepAnswer.addEventListener("click", () => {
    if (lastAnswer === null) return;
    addMessage("assistant", lastAnswer);
    $(".content", addMessage("user", "")).focus();
    lastAnswer = null;
    el.keepAnswer.disabled = true;
  });

  const EXAMPLES = {
    json_schema: JSON.stringify(
      {
        type: "object",
        properties: { city: { type: "string" }, country: { type: "string" } },
        required: ["city", "country"],
      },
      null,
      2,
    ),
    regex: "[0-9]{4}-[0-9]{2}-[0-9]{2}",
  };
  let constraintKind = "";
  el.structured.addEventListener("change", () => {
    const kind = el.structured.value;
    const hasText = kind === "json_schema" || kind === "regex";
    el.constraintLabel.hidden = !hasText;
    if (hasText && kind !== constraintKind) el.constraint.value = EXAMPLES[kind];
    constraintKind = kind;
  });

  // Ctrl+Enter (or Cmd+Enter) in any field sends
  el.form.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      el.form.requestSubmit();
    }
  });

  function number(input, name, integer) {
    const text = input.value.trim();
    if (text === "") return undefined;
    const value = Number(text);
    if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
      throw new Error(`${name} must be ${integer ? "a whole number" : "a number"}, not ${JSON.stringify(text)}`);
    }
    return value;
  }

  // one stop string per line; \n, \t and \\ are escapes
  function stopStrings() {
    return el.stop.value
      .split("\n")
      .filter((line) => line !== "")
      .map((line) => line.replace(/\\(n|t|\\)/g, (_, c) => (c === "n" ? "\n" : c === "t" ? "\t" : "\\")));
  }

  function buildRequest() {
    const chat = mode() === "chat";
    const body = {};
    if (el.model.value) body.model = el.model.value;
    if (chat) {
      body.messages = [...el.messages.children].map((item) => ({
        role: $(".role", item).value,
        content: $(".content", item).value,
      }));
    } else {
      body.prompt = el.prompt.value;
    }
    const fields = {
      temperature: number(el.temperature, "Temperature", false),
      top_p: number(el.topP, "Top-p", false),
      max_tokens: number(el.maxTokens, "Max tokens", true),
      seed: number(el.seed, "Seed", true),
      n: number(el.n, "n", true),
    };
    for (const [name, value] of Object.entries(fields)) if (value !== undefined) body[name] = value;
    const stop = stopStrings();
    if (stop.length) body.stop = stop;
    const alternatives = number(el.alternatives, "Top alternatives", true);
    if (alternatives !== undefined) {
      if (chat) {
        body.logprobs = true;
        body.top_logprobs = alternatives;
      } else {
        body.logprobs = alternatives;
      }
    }
    if (!chat && el.echo.checked) body.echo = true;
    const kind = el.structured.value;
    if (kind === "json_schema") {
      let schema;
      try {
        schema = JSON.parse(el.constraint.value);
      } catch (error) {
        throw new Error(`The JSON schema is not JSON: ${error.message}`);
      }
      body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
    } else if (kind === "json_object") {
      body.response_format = { type: "json_object" };
    } else if (kind === "regex") {
      body.structured_outputs = { regex: el.constraint.value };
    }
    if (el.stream.checked) {
      body.stream = true;
      body.stream_options = { include_usage: true };
    }
    return { path: chat ? "v1/chat/completions" : "v1/completions", body, chat };
  }

  // -- tokens -----------------------------------------------------------------------------------------------------
  // every token on the page, across choices, in order: {text, logprob, top: [[token, logprob], ...], choice, span}
  let tokens = [];
  let active = -1; // the token that holds the answer's tab stop

  const probabilityClass = (logprob) =>
    logprob === null || logprob === undefined ? "pnull" : `p${Math.min(9, Math.floor(Math.exp(logprob) * 10))}`;

  function visible(text) {
    if (text === "") return "(empty)";
    return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
  }

  function percent(logprob) {
    const p = Math.exp(logprob) * 100;
    if (p >= 99.95) return "100 %";
    if (p < 0.1) return "< 0.1 %";
    return `${p.toFixed(1)} %`;
  }

  class ChoiceView {
    constructor(index) {
      this.index = index;
      this.root = document.createElement("section");
      this.root.className = "choice";
      this.root.dataset.index = String(index);
      const head = document.createElement("h3");
      head.textContent = `Choice ${index}`;
      this.finish = document.createElement("span");
      this.finish.className = "finish";
      head.append(" ", this.finish);
      this.reasoning = document.createElement("div");
      this.reasoning.className = "reasoning";
      this.reasoning.hidden = true;
      this.text = document.createElement("div");
      this.text.className = "text";
      this.root.append(head, this.reasoning, this.text);
      this.count = 0; // tokens (or text pieces) rendered
      this.chunks = 0;
      this.content = "";
    }

    addTokens(list, prompt) {
      const fragment = document.createDocumentFragment();
      for (const token of list) {
        const span = document.createElement("span");
        const i = tokens.length;
        const shape = token.text === "" ? " empty" : /^\n+$/.test(token.text) ? " nl" : "";
        span.className = `tok ${probabilityClass(token.logprob)}${prompt ? " prompt" : ""}${shape}`;
        span.textContent = token.text;
        span.tabIndex = i === 0 ? 0 : -1;
        span.dataset.i = String(i);
        span.dataset.logprob = token.logprob === null || token.logprob === undefined ? "" : String(token.logprob);
        tokens.push({ ...token, prompt, choice: this.index, span });
        if (i === 0) active = 0;
        fragment.append(span);
        this.content += token.text;
      }
      this.text.append(fragment);
      this.count += list.length;
    }

    addText(text) {
      if (!text) return;
      const span = document.createElement("span");
      span.className = "plain";
      span.textContent = text;
      this.text.append(span);
      this.content += text;
      this.count += 1;
    }

    addReasoning(text) {
      if (!text) return;
      this.reasoning.hidden = false;
      this.reasoning.append(text);
    }

    // after an echoed stream: the first `count` tokens of this choice are the prompt's
    markPrompt(count) {
      let seen = 0;
      for (const token of tokens) {
        if (token.choice !== this.index) continue;
        token.prompt = seen < count;
        token.span.classList.toggle("prompt", token.prompt);
        seen += 1;
      }
    }

    done(reason) {
      this.finish.textContent = reason ? `finish_reason: ${reason}` : "";
      this.root.dataset.finish = reason || "";
    }
  }

  // completions' four lists -> token entries
  function completionTokens(logprobs) {
    if (!logprobs || !logprobs.tokens) return null;
    return logprobs.tokens.map((text, i) => {
      const top = logprobs.top_logprobs ? logprobs.top_logprobs[i] : null;
      return {
        text,
        logprob: logprobs.token_logprobs[i],
        top: top ? Object.entries(top) : [],
      };
    });
  }

  // chat's logprobs.content -> token entries
  function chatTokens(logprobs) {
    if (!logprobs || !Array.isArray(logprobs.content)) return null;
    return logprobs.content.map((entry) => ({
      text: entry.token,
      logprob: entry.logprob,
      top: (entry.top_logprobs || []).map((alt) => [alt.token, alt.logprob]),
    }));
  }

  function showToken(i) {
    const token = tokens[i];
    if (!token) return;
    const head = document.createElement("div");
    head.className = "info-head";
    const sample = document.createElement("code");
    sample.className = `tok ${probabilityClass(token.logprob)}${token.prompt ? " prompt" : ""}`;
    sample.textContent = visible(token.text);
    const numbers = document.createElement("span");
    numbers.className = "numbers";
    numbers.dataset.logprob = token.logprob === null || token.logprob === undefined ? "" : String(token.logprob);
    numbers.textContent =
      token.logprob === null || token.logprob === undefined
        ? "no logprob (nothing comes before the first prompt token)"
        : `logprob ${token.logprob.toFixed(4)} · p ${percent(token.logprob)}`;
    const where = document.createElement("span");
    where.className = "where";
    const position = tokens.slice(0, i + 1).filter((t) => t.choice === token.choice).length - 1;
    where.textContent = `choice ${token.choice} · token ${position}${token.prompt ? " · prompt" : ""}`;
    head.append(sample, " ", numbers, " ", where);

    const parts = [head];
    if (token.top.length) {
      const table = document.createElement("table");
      table.className = "alternatives";
      const caption = document.createElement("caption");
      caption.textContent = "Most likely tokens here";
      const thead = document.createElement("thead");
      thead.innerHTML = "<tr><th scope=col>token</th><th scope=col>logprob</th><th scope=col>probability</th></tr>";
      const tbody = document.createElement("tbody");
      const sorted = [...token.top].sort((a, b) => b[1] - a[1]); // JSON objects put integer-like keys first
      for (const [text, logprob] of sorted) {
        const row = document.createElement("tr");
        row.dataset.token = text;
        row.dataset.logprob = String(logprob);
        if (text === token.text && logprob === token.logprob) row.className = "chosen";
        const name = document.createElement("td");
        const code = document.createElement("code");
        code.textContent = visible(text);
        name.append(code);
        const value = document.createElement("td");
        value.textContent = logprob.toFixed(4);
        const bar = document.createElement("td");
        const meter = document.createElement("meter");
        meter.min = 0;
        meter.max = 1;
        meter.value = Math.exp(logprob);
        bar.append(meter, ` ${percent(logprob)}`);
        row.append(name, value, bar);
        tbody.append(row);
      }
      table.append(caption, thead, tbody);
      parts.push(table);
    }
    el.info.replaceChildren(...parts);
    el.info.dataset.i = String(i);
  }

  function focusToken(i) {
    if (i < 0 || i >= tokens.length) return;
    if (active >= 0 && tokens[active]) tokens[active].span.tabIndex = -1;
    active = i;
    tokens[i].span.tabIndex = 0;
    tokens[i].span.focus();
  }

  el.output.addEventListener("focusin", (event) => {
    const span = event.target.closest(".tok");
    if (!span) return;
    const i = Number(span.dataset.i);
    if (active >= 0 && tokens[active] && active !== i) tokens[active].span.tabIndex = -1;
    active = i;
    span.tabIndex = 0;
    showToken(i);
  });
  el.output.addEventListener("mouseover", (event) => {
    const span = event.target.closest(".tok");
    if (span) showToken(Number(span.dataset.i));
  });
  el.output.addEventListener("keydown", (event) => {
    const span = event.target.closest(".tok");
    if (!span) return;
    const i = Number(span.dataset.i);
    const moves = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tokens.length - 1 };
    if (event.key in moves) {
      event.preventDefault();
      focusToken(moves[event.key]);
    }
  });

  // -- timing -----------------------------------------------------------------------------------------------------
  function setTiming(key, text) {
    const cell = $(`dd[data-key="${key}"]`, el.timing);
    if (cell) cell.textContent = text;
  }

  function clearTiming(streamed) {
    for (const cell of el.timing.querySelectorAll("dd")) cell.textContent = "–";
    // what the browser timed: the first chunk of a stream, or the whole answer
    $("#client-ttft-label").textContent = streamed ? "first chunk (browser)" : "whole answer (browser)";
  }

  function showTiming(timing, usage) {
    if (timing) {
      const ms = (v) => (typeof v === "number" ? `${v.toFixed(1)} ms` : "–");
      setTiming("queue_ms", ms(timing.queue_ms));
      setTiming("prefill_ms", ms(timing.prefill_ms));
      setTiming("decode_ms", ms(timing.decode_ms));
      if (typeof timing.tokens_per_second === "number") setTiming("tokens_per_second", timing.tokens_per_second.toFixed(1));
      if (typeof timing.cached_prompt_tokens === "number") setTiming("cached_prompt_tokens", String(timing.cached_prompt_tokens));
      const drafted = timing.speculative_draft_tokens;
      const kept = timing.speculative_accepted_tokens;
      if (typeof drafted === "number" && typeof kept === "number") {
        const rate = drafted ? ` (${((kept / drafted) * 100).toFixed(0)} %)` : "";
        setTiming("speculative", `${kept} / ${drafted}${rate}`);
      }
    }
    if (usage) setTiming("usage", `${usage.prompt_tokens} / ${usage.completion_tokens}`);
  }

  // -- server-sent events -----------------------------------------------------------------------------------------
  // Calls onData with each `data:` frame's JSON until `data: [DONE]`; true when [DONE] came.
  async function readEvents(response, onData) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false;
      buffer += decoder.decode(value, { stream: true });
      // a lone \r may be the first half of a \r\n: keep it until the next read
      const held = buffer.endsWith("\r") ? "\r" : "";
      buffer = buffer.slice(0, buffer.length - held.length).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data === "") continue;
        if (data === "[DONE]") {
          reader.cancel().catch(() => {});
          return true;
        }
        onData(JSON.parse(data));
      }
      buffer += held;
    }
  }

  // -- a run ------------------------------------------------------------------------------------------------------
  let controller = null;
  let views = new Map();

  function view(index) {
    if (!views.has(index)) {
      const v = new ChoiceView(index);
      views.set(index, v);
      const after = [...views.keys()].filter((k) => k > index).sort((a, b) => a - b)[0];
      if (after === undefined) el.output.append(v.root);
      else el.output.insertBefore(v.root, views.get(after).root);
    }
    return views.get(index);
  }

  function resetAnswer(streamed) {
    clearError();
    clearTiming(streamed);
    tokens = [];
    active = -1;
    views = new Map();
    el.output.replaceChildren();
    const hint = document.createElement("p");
    hint.className = "placeholder";
    hint.textContent = "Point at a token, or focus one, to see its logprob and the most likely alternatives.";
    el.info.replaceChildren(hint);
    delete el.info.dataset.i;
  }

  function setState(state, message) {
    el.answer.dataset.state = state;
    el.output.setAttribute("aria-busy", state === "waiting" || state === "streaming" ? "true" : "false");
    if (message !== undefined) el.runStatus.textContent = message;
  }

  const tokenCount = () => [...views.values()].reduce((sum, v) => sum + v.count, 0);

  function keepScrolledToEnd(follow) {
    if (follow) el.output.scrollTop = el.output.scrollHeight;
  }

  const atEnd = () => el.output.scrollHeight - el.output.scrollTop - el.output.clientHeight < 24;

  function applyCompletionChoice(choice, echo, firstOfChoice, usagePromptTokens) {
    const v = view(choice.index);
    const list = completionTokens(choice.logprobs);
    if (list) {
      if (usagePromptTokens !== undefined) {
        v.addTokens(list.slice(0, usagePromptTokens), true);
        v.addTokens(list.slice(usagePromptTokens), false);
      } else {
        v.addTokens(list, echo && firstOfChoice);
      }
    } else {
      v.addText(choice.text);
    }
    if (choice.finish_reason) v.done(choice.finish_reason);
  }

  function applyChatChoice(choice, message) {
    const v = view(choice.index);
    const reasoning = message.reasoning ?? message.reasoning_content;
    if (reasoning) v.addReasoning(reasoning);
    const list = chatTokens(choice.logprobs);
    if (list) v.addTokens(list, false);
    else if (typeof message.content === "string") v.addText(message.content);
    if (choice.finish_reason) v.done(choice.finish_reason);
  }

  async function run(event) {
    event.preventDefault();
    if (controller) return;
    let request;
    try {
      request = buildRequest();
    } catch (error) {
      showError("", { message: error.message });
      return;
    }
    resetAnswer(request.body.stream === true);
    lastAnswer = null;
    el.keepAnswer.disabled = true;
    const { path, body, chat } = request;
    const echo = !chat && body.echo === true;
    controller = new AbortController();
    el.send.disabled = true;
    el.stopButton.disabled = false;
    setState("waiting", "Waiting for the server…");
    const started = performance.now();
    let firstChunk = null;
    let outcome = "done";
    try {
      const response = await fetch(path, {
        method: "POST",
        headers: headers(true),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!response.ok) {
        showError(response.status, await readError(response));
        outcome = "error";
        setState("error", `Failed: ${response.status}`);
        return;
      }
      if (body.stream) {
        setState("streaming", "Streaming…");
        const seenChoice = new Set();
        let usage = null;
        const finished = await readEvents(response, (chunk) => {
          if (chunk.error) {
            showError("Error in the stream:", chunk.error);
            outcome = "error";
            return;
          }
          if (firstChunk === null) {
            firstChunk = performance.now();
            setTiming("client_ttft_ms", `${(firstChunk - started).toFixed(1)} ms`);
          }
          const follow = atEnd();
          for (const choice of chunk.choices || []) {
            const first = !seenChoice.has(choice.index);
            seenChoice.add(choice.index);
            if (chat) applyChatChoice(choice, choice.delta || {});
            else applyCompletionChoice(choice, echo, first);
            view(choice.index).chunks += 1;
          }
          if (chunk.usage) {
            usage = chunk.usage;
            showTiming(chunk.timing, chunk.usage);
          }
          keepScrolledToEnd(follow);
          if (outcome !== "error") el.runStatus.textContent = `Streaming… ${tokenCount()} tokens`;
        });
        if (echo && usage && body.logprobs !== undefined) {
          for (const v of views.values()) v.markPrompt(usage.prompt_tokens);
        }
        if (!finished && outcome !== "error") {
          showError("", { message: "The stream ended before data: [DONE]" });
          outcome = "error";
        }
      } else {
        const data = await response.json();
        firstChunk = performance.now();
        setTiming("client_ttft_ms", `${(firstChunk - started).toFixed(1)} ms`);
        const promptTokens = echo && data.usage ? data.usage.prompt_tokens : undefined;
        for (const choice of data.choices) {
          if (chat) applyChatChoice(choice, choice.message || {});
          else applyCompletionChoice(choice, echo, true, promptTokens);
        }
        showTiming(data.timing, data.usage);
      }
      if (chat && views.has(0)) {
        lastAnswer = views.get(0).content;
        el.keepAnswer.disabled = false;
      }
      const seconds = ((performance.now() - started) / 1000).toFixed(2);
      if (outcome === "done") setState("done", `Done: ${tokenCount()} tokens in ${seconds} s.`);
      else setState("error", "Failed.");
    } catch (error) {
      if (error.name === "AbortError") {
        outcome = "stopped";
        setState("stopped", `Stopped after ${tokenCount()} tokens.`);
      } else {
        outcome = "error";
        showError("", { message: `The request failed: ${error.message}` });
        setState("error", "Failed.");
      }
    } finally {
      controller = null;
      el.send.disabled = false;
      el.stopButton.disabled = true;
    }
  }

  el.form.addEventListener("submit", run);
  el.stopButton.addEventListener("click", () => {
    if (controller) controller.abort();
  });

  // -- the live view of /metrics ----------------------------------------------------------------------------------
  // Prometheus text: each series' value, summed over its labels
  function parseMetrics(text) {
    const values = new Map();
    for (const line of text.split("\n")) {
      if (line === "" || line.startsWith("#")) continue;
      const match = /^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)/.exec(line);
      if (!match) continue;
      const value = Number(match[3].replace(/^\+Inf$/, "Infinity"));
      if (Number.isNaN(value)) continue;
      values.set(match[1], (values.get(match[1]) || 0) + value);
    }
    return values;
  }

  const CHARTS = [
    { id: "running", title: "Running requests", format: (v) => v.toFixed(0), floor: 1 },
    { id: "waiting", title: "Waiting requests", format: (v) => v.toFixed(0), floor: 1 },
    { id: "kv", title: "KV cache usage", format: (v) => `${v >= 10 ? v.toFixed(1) : v.toFixed(2)} %`, floor: 0.1 },
    { id: "tps", title: "Tokens/s generated", format: (v) => v.toFixed(1), floor: 1 },
    { id: "ttft", title: "Time to first token", format: (v) => `${v.toFixed(0)} ms`, floor: 10 },
    { id: "itl", title: "Inter-token latency", format: (v) => `${v.toFixed(1)} ms`, floor: 1 },
  ];
  const SVG = "http://www.w3.org/2000/svg";
  const WIDTH = 300;
  const HEIGHT = 64;
  const series = new Map(CHARTS.map((c) => [c.id, []])); // [{t, v}] with v null where there is no value

  function makeChart(chart) {
    const figure = document.createElement("figure");
    figure.className = "chart";
    figure.dataset.metric = chart.id;
    figure.dataset.value = "";
    const caption = document.createElement("figcaption");
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = chart.title;
    const value = document.createElement("output");
    value.className = "value";
    value.textContent = "–";
    caption.append(name, value);
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", chart.title);
    for (const y of [0.25, 0.5, 0.75]) {
      const grid = document.createElementNS(SVG, "line");
      grid.setAttribute("class", "grid");
      grid.setAttribute("x1", "0");
      grid.setAttribute("x2", String(WIDTH));
      grid.setAttribute("y1", String(HEIGHT * y));
      grid.setAttribute("y2", String(HEIGHT * y));
      grid.setAttribute("vector-effect", "non-scaling-stroke");
      svg.append(grid);
    }
    const area = document.createElementNS(SVG, "path");
    area.setAttribute("class", "area");
    const line = document.createElementNS(SVG, "path");
    line.setAttribute("class", "line");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    const dots = document.createElementNS(SVG, "path"); // values with no neighbour: round dots
    dots.setAttribute("class", "dots");
    dots.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(area, line, dots);
    const axis = document.createElement("div");
    axis.className = "axis";
    const left = document.createElement("span");
    left.className = "since";
    const top = document.createElement("span");
    top.className = "max";
    const right = document.createElement("span");
    right.textContent = "now";
    axis.append(left, top, right);
    figure.append(caption, svg, axis);
    el.charts.append(figure);
    return { figure, value, svg, area, line, dots, top, left };
  }
  const chartViews = new Map(CHARTS.map((c) => [c.id, makeChart(c)]));

  function drawChart(chart, now) {
    series.set(chart.id, series.get(chart.id).filter((p) => p.t >= now - KEEP_S));
    const shown = Number(el.liveWindow.value) || 300;
    const points = series.get(chart.id).filter((p) => p.t >= now - shown);
    const parts = chartViews.get(chart.id);
    const numbers = points.filter((p) => p.v !== null).map((p) => p.v);
    const max = Math.max(chart.floor, ...numbers) * 1.1;
    const x = (t) => (((t - (now - shown)) / shown) * WIDTH).toFixed(1);
    const y = (v) => (HEIGHT - 1 - (Math.min(v, max) / max) * (HEIGHT - 2)).toFixed(1);
    let line = "";
    let area = "";
    let dots = "";
    let run = [];
    const flush = () => {
      if (run.length === 0) return;
      if (run.length === 1) dots += `M${x(run[0].t)},${y(run[0].v)}h0.01`;
      else line += run.map((p, i) => `${i ? "L" : "M"}${x(p.t)},${y(p.v)}`).join("");
      area += `M${x(run[0].t)},${HEIGHT}` + run.map((p) => `L${x(p.t)},${y(p.v)}`).join("") + `L${x(run[run.length - 1].t)},${HEIGHT}Z`;
      run = [];
    };
    for (const p of points) {
      if (p.v === null) flush();
      else run.push(p);
    }
    flush();
    parts.line.setAttribute("d", line);
    parts.dots.setAttribute("d", dots);
    parts.area.setAttribute("d", area);
    parts.top.textContent = `max ${chart.format(max / 1.1)}`;
    parts.left.textContent = `−${shown / 60} min`;
    const last = points.length ? points[points.length - 1].v : null;
    parts.value.textContent = last === null ? "–" : chart.format(last);
    parts.figure.dataset.value = last === null ? "" : String(last);
    parts.figure.dataset.points = String(points.length);
    parts.figure.dataset.max = numbers.length ? String(Math.max(...numbers)) : "";
    parts.svg.setAttribute(
      "aria-label",
      `${chart.title} over the last ${shown / 60} minutes: now ${last === null ? "no value" : chart.format(last)}`,
    );
  }

  let previous = null;
  let polling = false;

  function rate(now, before, name, t) {
    if (!before) return null;
    const delta = now.get(name) - before.values.get(name);
    const seconds = t - before.t;
    if (!(delta >= 0) || !(seconds > 0)) return null; // a restarted worker's counters start again
    return delta / seconds;
  }

  function mean(now, before, name) {
    if (!before) return null;
    const count = now.get(`${name}_count`) - before.values.get(`${name}_count`);
    const sum = now.get(`${name}_sum`) - before.values.get(`${name}_sum`);
    if (!(count > 0) || !(sum >= 0)) return null;
    return (sum / count) * 1000;
  }

  async function poll() {
    if (polling) return;
    polling = true;
    try {
      const response = await fetch("metrics", { headers: headers(false), cache: "no-store" });
      if (!response.ok) {
        const error = await readError(response);
        el.liveStatus.textContent = `/metrics: ${response.status} ${error.message}`;
        return;
      }
      const values = parseMetrics(await response.text());
      const t = Date.now() / 1000;
      const sample = {
        running: values.get("saker_requests_running") ?? null,
        waiting: values.get("saker_queue_depth") ?? null,
        kv: values.has("saker_kv_cache_usage") ? values.get("saker_kv_cache_usage") * 100 : null,
        tps: rate(values, previous, "saker_generation_tokens_total", t),
        ttft: mean(values, previous, "saker_time_to_first_token_seconds"),
        itl: mean(values, previous, "saker_time_per_output_token_seconds"),
      };
      for (const chart of CHARTS) series.get(chart.id).push({ t, v: sample[chart.id] });
      previous = { t, values };
      el.liveStatus.textContent = `updated ${new Date(t * 1000).toLocaleTimeString()}`;
      el.charts.dataset.polls = String(Number(el.charts.dataset.polls || 0) + 1);
    } catch (error) {
      el.liveStatus.textContent = `/metrics: ${error.message}`;
    } finally {
      polling = false;
      const now = Date.now() / 1000;
      for (const chart of CHARTS) drawChart(chart, now);
    }
  }

  let timer = null;
  function schedule() {
    clearInterval(timer);
    timer = null;
    if (el.liveOn.checked) {
      poll();
      timer = setInterval(poll, POLL_MS);
    } else {
      el.liveStatus.textContent = "paused";
    }
  }
  el.liveOn.addEventListener("change", schedule);
  el.liveWindow.addEventListener("change", () => {
    const now = Date.now() / 1000;
    for (const chart of CHARTS) drawChart(chart, now);
  });

  setState("idle");
  loadModels();
  schedule();
})();
