"""Security rules checked on every CI run: no unsafe deserialization in our code, and a limit on every RPC handler.

1. Source scan (``ast``, not regex): ``template/``, ``neurons/`` and ``scripts/`` must not call ``pickle``-family
   loaders, ``marshal``/``shelve`` loads, ``torch.load`` without a literal ``weights_only=True``, ``numpy.load`` with
   ``allow_pickle``, ``yaml`` loaders that build arbitrary objects, torch.distributed's pickling object collectives,
   or the ``eval``/``exec`` builtins. Imports are followed (``from pickle import loads as l``; ``import torch as t``),
   and the scanner is shown catching each rule on synthetic sources, so a passing scan means something.
2. RPC handlers: every handler our code registers on a libp2p host (``add_binary_stream_handler``,
   ``add_protobuf_handler``, ``add_p2p_handlers`` calls, and the ``rpc_*`` methods of our hivemind servicers, inherited
   ones included) must appear in :data:`HANDLERS`, saying how its request size and its per-peer call rate are
   bounded and which test shows it. Where a bound is missing, the entry says so (:class:`Gap`) and the test pins the
   list of gaps: a new handler without limits, or a limit claimed by a test that does not exist, fails here.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p.servicer import ServicerBase
from hivemind.proto import averaging_pb2

import template

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("template", "neurons", "scripts")

# --- 1. unsafe deserialization ------------------------------------------------------------------------------------

_PICKLERS = ("pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib")
ALWAYS_UNSAFE = {
    *(f"{module}.{name}" for module in _PICKLERS for name in ("load", "loads", "Unpickler")),
    "marshal.load", "marshal.loads", "shelve.open", "pandas.read_pickle", "yaml.unsafe_load", "yaml.full_load",
    "yaml.unsafe_load_all", "yaml.full_load_all",
    *(f"torch.distributed.{name}" for name in ("broadcast_object_list", "all_gather_object", "gather_object",
                                                "scatter_object_list", "recv_object_list")),
    "eval", "exec", "builtins.eval", "builtins.exec", "multiprocessing.reduction.ForkingPickler.loads",
}
# Reviewed uses, each with why it is safe; the scan fails if one disappears (an allowance must not outlive its use).
REVIEWED = {
    "template/p2p/hivemind_compat.py": (
        "multiprocessing.reduction.ForkingPickler.loads()",
        "the DHT process reads its own request pipe as hivemind's Connection.recv does: requests of this machine's own "
        "forked processes on a local pipe, never bytes from the network or another peer"),
}
SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader"}


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import in the module."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """``np.load`` -> ``numpy.load`` through the imports; None for anything that is not a plain name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(names.get(node.id, node.id))
    return ".".join(reversed(parts))


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_calls(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: what`` for every call that can deserialize arbitrary objects or run arbitrary code."""
    tree = ast.parse(source, filename)
    names = _imports(tree)
    findings = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = _dotted(node.func, names)
        if target is None:
            continue
        problem = None
        if target in ALWAYS_UNSAFE:
            problem = f"{target}()"
        elif target in ("torch.load", "torch.serialization.load") and not _is_true(_keyword(node, "weights_only")):
            problem = f"{target}() without weights_only=True"
        elif target == "numpy.load" and _keyword(node, "allow_pickle") is not None and not (
            isinstance(_keyword(node, "allow_pickle"), ast.Constant) and _keyword(node, "allow_pickle").value is False
        ):
            problem = "numpy.load() with allow_pickle"
        elif target in ("yaml.load", "yaml.load_all"):
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if loader is None or _dotted(loader, names) not in SAFE_YAML_LOADERS:
                problem = f"{target}() without a safe Loader"
        elif target.endswith("PickleSerializer.loads"):
            problem = f"{target}()"
        if problem:
            findings.append(f"{filename}:{node.lineno}: {problem}")
    return findings


def scanned_files() -> list[Path]:
    return sorted(path for folder in SCANNED for path in (REPO / folder).rglob("*.py"))


def test_our_sources_deserialize_nothing_unsafely():
    files = scanned_files()
    assert len(files) > 30 and any(p.name == "miner.py" for p in files)  # the scan really covers the code base
    findings = [f for path in files for f in unsafe_calls(path.read_text(), str(path.relative_to(REPO)))]
    reviewed = [f for f in findings if f.split(":")[0] in REVIEWED and f.endswith(REVIEWED[f.split(":")[0]][0])]
    assert sorted({f.split(":")[0] for f in reviewed}) == sorted(REVIEWED), "a reviewed use is gone: drop its entry"
    unsafe = [f for f in findings if f not in reviewed]
    assert not unsafe, "unsafe deserialization or code execution:\n" + "\n".join(unsafe)


@pytest.mark.parametrize(
    "source",
    [
        "import pickle\npickle.loads(data)",
        "import pickle\nobj = pickle.load(open('f', 'rb'))",
        "import pickle as p\np.Unpickler(f).load()",
        "from pickle import loads\nloads(b)",
        "from pickle import loads as harmless\nharmless(b)",
        "import _pickle\n_pickle.loads(b)",
        "import dill\ndill.loads(b)",
        "import joblib\njoblib.load('model.pkl')",
        "import marshal\nmarshal.loads(code)",
        "import shelve\ndb = shelve.open('state')",
        "import torch\ntorch.load('ckpt.pt')",
        "import torch\ntorch.load('ckpt.pt', weights_only=False)",
        "import torch\ntorch.load('ckpt.pt', weights_only=flag)",
        "import torch as t\nt.load(buffer, map_location='cpu')",
        "from torch import load\nload(path)",
        "import torch.serialization\ntorch.serialization.load(f)",
        "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
        "import yaml\nyaml.load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.FullLoader)",
        "import yaml\nyaml.unsafe_load(text)",
        "import pandas as pd\npd.read_pickle('frame.pkl')",
        "import torch.distributed as dist\ndist.broadcast_object_list(objects, src=0)",
        "eval(received)",
        "exec(compile(received, 'x', 'exec'))",
        "import builtins\nbuiltins.eval(text)",
        "from hivemind.utils.serializer import PickleSerializer\nPickleSerializer.loads(blob)",
        "from multiprocessing.reduction import ForkingPickler\nForkingPickler.loads(data)",
        "def handler(message):\n    import pickle\n    return pickle.loads(message)",
    ],
)
def test_the_scanner_catches_each_unsafe_form(source):
    assert unsafe_calls(source), f"not caught:\n{source}"


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load('ckpt.pt', weights_only=True)",
        "import torch\ntorch.load(path, map_location='cpu', weights_only=True)",
        "import numpy as np\nnp.load('x.npy')",
        "import numpy as np\nnp.load('x.npy', allow_pickle=False)",
        "import yaml\nyaml.safe_load(text)\nyaml.load(text, Loader=yaml.SafeLoader)",
        "import json\njson.loads(data)",
        "import ast\nast.literal_eval(text)",
        "model.eval()\nself.eval()\nrunner.exec()",
        "from hivemind.utils.serializer import MSGPackSerializer\nMSGPackSerializer.loads(blob)",
        "from safetensors.torch import load_file\nload_file(path)",
        "# pickle.loads(x) in a comment\ntext = 'eval(x)'",
    ],
)
def test_the_scanner_leaves_safe_code_alone(source):
    assert unsafe_calls(source) == []


# --- 2. limits on every RPC handler ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limited:
    """A bound that exists, and the test that exercises it (``path::function``)."""

    how: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Gap:
    """No bound: why, and what would fix it. Listed in docs/reliability.md as open."""

    why: str


_HIVEMIND_FRAMING = Gap(
    "hivemind's stream framing (P2P.receive_raw_data) reads as many bytes as a frame's 8-byte header announces "
    "before our handler sees the message; bounding it needs a size cap in hivemind's P2P stream reader")

HANDLERS: dict[str, dict[str, Limited | Gap]] = {
    "add_binary_stream_handler(HANDLER_NAME) in template/p2p/publication.py": {
        "size": Limited("every frame's announced length is checked before it is read: requests against "
                        "max_request_bytes (miner), replies against MAX_REPLY_BYTES and CHUNK_BYTES (validator)",
                        ("tests/integration/test_publication.py::test_malformed_requests_get_a_clear_bad_request",
                         "tests/faults/test_publication_attacks.py::test_truncated_and_oversized_answers_are_refused",
                         "tests/faults/test_publication_attacks.py::"
                         "test_half_frames_silence_and_junk_close_the_stream_and_the_miner_keeps_serving")),
        "rate": Limited("sliding-window limit per remote PeerID (max_requests_per_minute); validator permit only",
                        ("tests/integration/test_publication.py::test_the_rate_limit_is_per_peer",
                         "tests/integration/test_publication.py::test_a_registered_hotkey_without_a_permit_is_refused")),
    },
    "CheckedAverager.rpc_join_group": {
        "size": _HIVEMIND_FRAMING,
        "rate": Limited("sliding-window limit per remote PeerID (AveragingConfig.max_join_requests_per_minute)",
                        ("tests/faults/test_rpc_limits.py::test_join_requests_beyond_the_allowance_are_refused",)),
    },
    "CheckedAverager.rpc_download_state": {
        "size": _HIVEMIND_FRAMING,
        "rate": Limited("sliding-window limit per remote PeerID (AveragingConfig.max_state_downloads_per_minute)",
                        ("tests/faults/test_rpc_limits.py::test_state_downloads_beyond_the_allowance_are_refused",)),
    },
    "CheckedAverager.rpc_aggregate_part": {
        "size": _HIVEMIND_FRAMING,
        "rate": Limited("served only for a running group's id and only to its members, one stream each (a second "
                        "one breaks part order and bans the sender); parts of the wrong size are dropped",
                        ("tests/faults/test_rpc_limits.py::test_parts_for_no_running_group_are_refused",
                         "tests/faults/test_rpc_limits.py::test_an_outsiders_parts_are_refused_by_the_group",
                         "tests/integration/test_averaging.py::test_reducer_drops_bad_parts_and_clips_to_the_lower_median")),
    },
    "CheckedAverager.rpc_fetch_share": {
        "size": _HIVEMIND_FRAMING,
        "rate": Limited("members of the sharer's latest group only (others: PROTOCOL_VIOLATION), within a per-peer "
                        "allowance (max_join_requests_per_minute; past it: BAD_GROUP_ID); a share still arriving is "
                        "waited for at most reducer_timeout / 2",
                        ("tests/faults/test_rpc_limits.py::"
                         "test_share_fetches_serve_the_groups_members_only_within_their_allowance",)),
    },
}
KNOWN_GAPS = {
    ("CheckedAverager.rpc_fetch_share", "size"),
    ("CheckedAverager.rpc_join_group", "size"),
    ("CheckedAverager.rpc_download_state", "size"),
    ("CheckedAverager.rpc_aggregate_part", "size"),
}
_REGISTRATIONS = ("add_binary_stream_handler", "add_protobuf_handler", "add_p2p_handlers")


def registered_handlers() -> set[str]:
    """Handlers our code puts on a libp2p host: explicit registrations, and our servicers' rpc_* methods."""
    found = set()
    for path in sorted((REPO / "template").rglob("*.py")) + sorted((REPO / "neurons").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _REGISTRATIONS:
                first = ast.unparse(node.args[0]) if node.args else "?"
                found.add(f"{node.func.attr}({first}) in {path.relative_to(REPO)}")
    for servicer in our_servicers():
        servicer._collect_rpc_handlers()
        found |= {f"{servicer.__name__}.{handler.method_name}" for handler in servicer._rpc_handlers}
    return found


def our_servicers() -> list[type]:
    """Every hivemind servicer class defined in the ``template`` package (importing all of it)."""
    for module in pkgutil.walk_packages(template.__path__, "template."):
        importlib.import_module(module.name)
    classes = []
    for name, module in list(sys.modules.items()):
        if name == "template" or name.startswith("template."):
            classes += [c for _, c in inspect.getmembers(module, inspect.isclass)
                        if issubclass(c, ServicerBase) and c.__module__ == name]
    return sorted(set(classes), key=lambda c: c.__name__)


def _test_exists(reference: str) -> bool:
    path, function = reference.split("::")
    source = (REPO / path).read_text() if (REPO / path).exists() else ""
    return re.search(rf"^def {re.escape(function)}\(", source, re.M) is not None


def test_every_rpc_handler_is_accounted_for():
    handlers = registered_handlers()
    assert "CheckedAverager.rpc_aggregate_part" in handlers  # the enumeration sees inherited handlers too
    assert handlers == set(HANDLERS), (
        f"handlers without a reviewed entry: {sorted(handlers - set(HANDLERS))}; "
        f"entries for handlers that no longer exist: {sorted(set(HANDLERS) - handlers)}")


def test_every_claimed_limit_is_exercised_by_an_existing_test():
    for handler, limits in HANDLERS.items():
        assert set(limits) == {"size", "rate"}, handler
        for kind, limit in limits.items():
            if isinstance(limit, Limited):
                missing = [t for t in limit.tests if not _test_exists(t)]
                assert limit.tests and not missing, f"{handler} ({kind}): no such test {missing}"


def test_the_open_gaps_are_exactly_the_known_ones():
    gaps = {(handler, kind) for handler, limits in HANDLERS.items() for kind, limit in limits.items()
            if isinstance(limit, Gap)}
    assert gaps == KNOWN_GAPS
    documented = (REPO / "docs" / "reliability.md").read_text()
    for handler, _ in gaps:
        assert handler in documented, f"{handler}: an open gap must be listed in docs/reliability.md"


def test_our_servicer_handlers_keep_hiveminds_wire_form():
    """hivemind derives a handler's wire form (unary or streamed) from its annotations and recognizes typing's
    ``AsyncIterator`` only; an override annotated with ``collections.abc.AsyncIterator`` silently turns a streamed
    handler into a unary one that no stock peer can call. Our averagers' handlers must keep hivemind's forms, and our
    one handler of our own (the relay of a missed share) is a unary request answered by a stream. (A runner's
    ``rpc_aggregate_part`` is called in-process by its averager, never registered, so it is not checked.)"""
    DecentralizedAverager._collect_rpc_handlers()
    expected = {handler.method_name: handler for handler in DecentralizedAverager._rpc_handlers}
    averagers = [s for s in our_servicers() if issubclass(s, DecentralizedAverager)]
    assert averagers
    for averager in averagers:
        averager._collect_rpc_handlers()
        ours = {handler.method_name: handler for handler in averager._rpc_handlers}
        assert {name: ours[name] for name in expected} == expected, averager.__name__
        assert set(ours) - set(expected) == {"rpc_fetch_share"}, averager.__name__
        relay = ours["rpc_fetch_share"]
        assert (relay.stream_input, relay.stream_output) == (False, True)
        assert relay.request_type is relay.response_type is averaging_pb2.AveragingData
