"""``python -m app bench`` (``saker bench``, ``make bench``): the performance suite (issue 6; docs/performance.md).
A benchmark, not a test: it measures, prints a table, and writes ``bench.json`` and ``bench.png`` into
``docs/performance/`` (``--out-dir``).

The bench starts its own gunicorn (``SAKER_MODEL`` = a generated model) unless ``--url`` points at a running
OpenAI-compatible server; then only the HTTP-side measurements run (no in-process references, no ratios that need
them; S measures that server's chat endpoint; R measures that server as it serves, since the bench cannot switch
its cache). Models are built once into ``--cache-dir`` (default ``.cache/bench``).

Torch threads: the bench process and the server use the same number (``--threads``, default: torch's default
here); the server gets it as OMP_NUM_THREADS/MKL_NUM_THREADS, the bench calls ``torch.set_num_threads``.

Where things are: ``cli`` (flags, main), ``runner`` (``Bench``: one run, the order of the parts, the servers it
starts), ``parts/`` (one module per part, and ``PARTS``), ``plan`` (how much each part does, full or ``--quick``;
the goals), ``models`` (the generated models), ``client`` (the timed HTTP client, closed loops), ``server`` (our
gunicorn), ``stats``, ``machine`` (the machine, other processes' CPU share), ``report`` (table, JSON, plot),
``profile`` (py-spy), and ``replicas``/``nginx`` (``python -m tooling.bench.replicas``: replicas behind nginx).

"""

from tooling.bench.parts import overview as _overview

__doc__ = (__doc__ or "") + _overview() + "\n"
