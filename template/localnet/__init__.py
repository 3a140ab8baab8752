"""The local network: the whole subnet on this machine in one command, ``python -m template.localnet``.

``network`` starts the mock chain, the validator and the miners and runs them to a report (its docstring says what
happens on failure and which exit status follows); ``view`` is the terminal view while it runs; ``report`` judges
the run from the neurons' events and the chain and writes ``report.json``, plots and ``report.html``. This package
only gathers their public names.
"""

from template.localnet.network import RUN_MARKER_ENV, Localnet, LocalnetConfig, main
from template.localnet.report import ChainSnapshot, NeuronInfo, build_report, write_report

__all__ = ["RUN_MARKER_ENV", "ChainSnapshot", "Localnet", "LocalnetConfig", "NeuronInfo", "build_report", "main",
           "write_report"]
