"""The chat template: which one (``SAKER_CHAT_TEMPLATE`` or the tokenizer's), rendering messages (and tools) to
token ids, and whether it renders tools at all (probed once)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.errors import InvalidRequestError
from app.settings import Settings

if TYPE_CHECKING:  # the worker (and torch) stay out of this module's imports
    from app.engine.core.worker import Worker


class ChatTemplate:
    def __init__(self, settings: Settings, worker: Worker):
        from app.tool_calls import tool_format

        self.settings = settings
        self.worker = worker
        self.tool_format = tool_format(settings.tool_call_parser)  # how tools are put into a template without them
        self._text: str | None = None
        self._takes_tools: bool | None = None

    def text(self) -> str | None:
        """SAKER_CHAT_TEMPLATE (a file or an inline Jinja string), else the tokenizer's own."""
        if self._text is None:
            self._text = (
                self.settings.chat_template_text() or getattr(self.worker.tokenizer, "chat_template", None) or ""
            )
        return self._text or None

    def apply(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tokenize: bool,
        tools: list[dict] | None = None,
        options: dict | None = None,
    ):
        template = self.text()
        if not template:
            raise InvalidRequestError(
                "This model has no chat template. Set one with SAKER_CHAT_TEMPLATE (a Jinja file or string), "
                "or use /v1/completions",
                param="messages",
            )
        try:
            return self.worker.tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=tokenize,
                add_generation_prompt=add_generation_prompt,
                return_dict=False,
                tools=tools,
                **(options or {}),
            )
        except Exception as exc:
            raise InvalidRequestError(
                f"the chat template could not render these messages: {exc}", param="messages"
            ) from None

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        options: dict | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation; the template carries BOS, none is added a second time. With tools
        and a template that does not render them, the tools go into the system message in the tool-call format's own
        words (``tool_format.prompt``), and the conversation's calls and tool results as text."""
        if tools and not self.takes_tools():
            messages, tools = self.tool_format.prompt(messages, tools), None
        ids = self.apply(messages, add_generation_prompt, tokenize=True, tools=tools, options=options)
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return list(ids)

    def takes_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (a probe conversation comes out different with one)."""
        if self._takes_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            tool = [
                {
                    "type": "function",
                    "function": {
                        "name": "saker_probe_tool",
                        "description": "probe",
                        "parameters": {"type": "object", "properties": {}},
                    },
                }
            ]
            plain = self.apply(probe, True, tokenize=False)  # a template that fails says so itself
            try:
                self._takes_tools = self.apply(probe, True, tokenize=False, tools=tool) != plain
            except InvalidRequestError:
                self._takes_tools = False
        return self._takes_tools
