"""The house's shape, held by reading its source: no import circles, no peer or upward imports, and one
definition each of the LoRA scale, merge, PEFT config and defaults (lorarl.contract).

Imports are read statically (ast), function-level ones included: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from lorarl.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lorarl",)
#: Generated from protos/: not part of the import rules.
GENERATED = "lorarl/v1"


@functools.cache  # the source does not change during a run: read and parsed once for every rule
def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if path.is_relative_to(ROOT / GENERATED):
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the house's modules it imports (anywhere in its body)."""
    known = modules()

    def resolve(name: str) -> str | None:
        if name == "lorarl.v1" or name.startswith("lorarl.v1."):
            return None  # generated: outside the rules
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in known else resolve(base))
        graph[name] = {d for d in deps if d and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: (importer prefix, imported prefix) pairs that must not occur: peers apart, shared layers below services.
FORBIDDEN = [
    ("lorarl.rollout", "lorarl.trainer"),
    ("lorarl.trainer", "lorarl.rollout"),
    ("lorarl.weightsync", "lorarl.trainer"),
    ("lorarl.weightsync", "lorarl.rollout"),
    ("lorarl.common", "lorarl.trainer"),
    ("lorarl.common", "lorarl.rollout"),
    ("lorarl.common", "lorarl.weightsync"),
    ("lorarl.contract", "lorarl.trainer"),
    ("lorarl.contract", "lorarl.rollout"),
    ("lorarl.contract", "lorarl.weightsync"),
    # the contract is the floor the services stand on: it imports no lorarl package above it (#47 step 0)
    ("lorarl.contract", "lorarl.common"),
    # the shipped assets (tiny models, tasks, their evaluation) lean on the contract only, never on a service
    *(("lorarl.assets", service) for service in ("lorarl.trainer", "lorarl.rollout", "lorarl.weightsync",
                                                 "lorarl.tinker", "lorarl.client")),
    *((service, "lorarl.client") for service in
      ("lorarl.common", "lorarl.contract", "lorarl.trainer", "lorarl.rollout", "lorarl.weightsync",
       "lorarl.tinker")),
    # the Tinker front reaches the services over gRPC only, and none of them knows it
    *(("lorarl.tinker", service) for service in ("lorarl.trainer", "lorarl.rollout", "lorarl.weightsync")),
    *((service, "lorarl.tinker") for service in ("lorarl.common", "lorarl.contract", "lorarl.trainer",
                                                 "lorarl.rollout", "lorarl.weightsync")),
    # the client's rooms: commands (the CLI) on top; the SDK, the loop (rl) and the launchers beside each other
    # over what a job is (job); none of them imports a command
    *((room, "lorarl.client.commands") for room in
      ("lorarl.client.job", "lorarl.client.rl", "lorarl.client.launch", "lorarl.client.workflow",
       "lorarl.client.sdk", "lorarl.client.calls")),
    *(("lorarl.client.job", room) for room in ("lorarl.client.rl", "lorarl.client.launch", "lorarl.client.sdk")),
    *(("lorarl.client.rl", room) for room in ("lorarl.client.launch", "lorarl.client.sdk")),
    *(("lorarl.client.launch", room) for room in ("lorarl.client.rl", "lorarl.client.sdk")),
    # weight sync: the libraries other processes embed never reach into the service
    ("lorarl.weightsync.client", "lorarl.weightsync.service"),
    ("lorarl.weightsync.wire", "lorarl.weightsync.service"),
    ("lorarl.weightsync.wire", "lorarl.weightsync.client"),
    ("lorarl.trainer", "lorarl.weightsync.service"),
    ("lorarl.rollout", "lorarl.weightsync.service"),
    # the rollout's segment runner reads the policy table and never loads a version itself
    ("lorarl.rollout.segments", "lorarl.rollout.policy_manager"),
    ("lorarl.rollout.segments", "lorarl.rollout.core"),
    # platform facts (lorarl.platform) sit below everything: they import no lorarl package but themselves
    *(("lorarl.platform", other) for other in ("lorarl.common", "lorarl.contract", "lorarl.trainer",
                                               "lorarl.rollout", "lorarl.weightsync", "lorarl.tinker",
                                               "lorarl.client")),
    # the trainer's layers, lowest first: rl < engines < ranks < service
    ("lorarl.trainer.rl", "lorarl.trainer.engines"),
    ("lorarl.trainer.rl", "lorarl.trainer.ranks"),
    ("lorarl.trainer.rl", "lorarl.trainer.service"),
    ("lorarl.trainer.engines", "lorarl.trainer.ranks"),
    ("lorarl.trainer.engines", "lorarl.trainer.service"),
    ("lorarl.trainer.ranks", "lorarl.trainer.service"),
    # the two engines in rooms of their own over a shared floor: neither reaches into the other
    ("lorarl.trainer.engines.megatron", "lorarl.trainer.engines.torch"),
    ("lorarl.trainer.engines.torch", "lorarl.trainer.engines.megatron"),
]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize(("importer", "imported"), FORBIDDEN)
def test_no_peer_or_upward_imports(importer: str, imported: str) -> None:
    edges = [f"{a} -> {b}" for a, deps in import_graph().items() if _under(a, importer)
             for b in deps if _under(b, imported)]
    assert edges == []


def code_lines(path: Path) -> list[tuple[int, str]]:
    """(number, text) of a file's lines of code: docstrings and comments left out."""
    text = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return [(i, line.split("  #")[0]) for i, line in enumerate(text.splitlines(), 1)
            if i not in docstrings and not line.lstrip().startswith("#")]


@functools.cache
def source_lines() -> list[tuple[str, int, str]]:
    return [(name, i, line) for name, path in modules().items() for i, line in code_lines(path)]


#: One definition (or one caller) each, nowhere but its home.
SINGLE_DEFINITIONS = {
    "LoRA scale": (re.compile(r"alpha\s*/\s*\(?\s*(math\.)?sqrt|alpha\s*/\s*\w*\.?rank\b"), "lorarl.contract.lora"),
    "LoRA merge": (re.compile(r"\.float\(\)\s*@\s*.*\.float\(\)"), "lorarl.contract.merge"),
    "PEFT config": (re.compile(r"""["']lora_alpha["']\s*:"""), "lorarl.contract.lora"),
    # the staleness rule: a version difference compared against a bound
    "staleness rule": (re.compile(r"version\s*-\s*[\w.]+\)?\s*<=\s*[\w.]*(staleness|bound)"),
                       "lorarl.contract.staleness"),
    # the enum maps the client and the services share: names <-> proto enums
    "loss type map": (re.compile(r"LOSS_TYPE_[A-Z_]+\s*:|[\"']\w+[\"']\s*:\s*trainer_pb2\.LOSS_TYPE"),
                      "lorarl.contract.enums"),
    "sync mode map": (re.compile(r"[\"']\w+[\"']\s*:\s*common_pb2\.SYNC_MODE"), "lorarl.contract.enums"),
    # the staleness mask: applied by the RL step alone (once per micro-batch, and in the batch's totals)
    "staleness mask": (re.compile(r"staleness\.fresh\("), "lorarl.trainer.rl.step"),
    # version numbering: the next version after the latest, nowhere but lorarl.contract.versions
    "version numbering": (re.compile(r"\b(latest|latest_version|_version|version)\s*(\+=|\+)\s*1\b"),
                          "lorarl.contract.versions"),
    # the training spec's defaults (learning rate, limits, weight cap, clip ranges): literals in one place
    "training defaults": (re.compile(r"\b\w*(learning_rate|max_sequence_tokens|max_buffered_trajectories|"
                                     r"behavior_weight_cap|clip_eps_\w+|weight_cap|LEARNING_RATE|SEQUENCE_TOKENS|"
                                     r"BUFFERED_TRAJECTORIES|WEIGHT_CAP|CLIP_EPS\w*)\s*(:\s*[\w| ]+\s*)?(=|or)\s*"
                                     r"(setting\()?[1-9][\d.]*(e-?\d+)?\b"), "lorarl.contract.training"),
    # the RL step: the one caller of the policy loss and of group advantages
    "policy loss call": (re.compile(r"(?<!def )\bpolicy_loss\("), "lorarl.trainer.rl.step"),
    "advantages call": (re.compile(r"(?<!def )\bcompute_advantages\("), "lorarl.trainer.rl.step"),
    # which jobs share a stack and what a shared rollout may be given: the launchers, attach, the trainer's
    # CreateJob, weight sync and the Tinker front all ask lorarl.contract.sharing
    "shared-stack rule": (re.compile(r"SHARED_KEYS\s*=|def (sharing_refusal|disagreement)\b|"
                                     r"replace the base weights every other job"), "lorarl.contract.sharing"),
    # routing replay (R3): which experts a replaying router takes, one rule for both engines
    "R3 expert selection": (re.compile(r"\.sort\(-1\)\.values\s*!="), "lorarl.trainer.rl.routing"),
    # platform facts: the one import of torch_npu, the one device -> collective backend map
    "torch_npu import": (re.compile(r"^\s*(import torch_npu|from torch_npu)"), "lorarl.platform.devices"),
    "device backend map": (re.compile(r"[\"']cuda[\"']\s*:\s*[\"']nccl[\"']"), "lorarl.platform.devices"),
    # the project's HTTP servers (the OpenAI endpoint, the Tinker front) start one way, with TLS and keep-alive
    "HTTP server start": (re.compile(r"uvicorn\.(Config|Server)\b"), "lorarl.common.http_server"),
    # one base (#44): where each checkpoint tensor lies in the shared copy (vLLM's fused projections), the shared
    # base's file format, the memory files themselves, and the one patch that keeps vLLM from repacking it
    "shared base layout": (re.compile(r"[\"']qkv_proj[\"']\s*:|[\"']gate_up_proj[\"']\s*:"),
                           "lorarl.contract.base_layout"),
    "shared base format": (re.compile(r"lorarl-shared-base-\d"), "lorarl.contract.base_segment"),
    "memory files": (re.compile(r"\bmemfd_create\("), "lorarl.platform.shared_memory"),
    # device memory shared between processes (CUDA IPC handles): the one place that makes and opens them
    "CUDA IPC handles": (re.compile(r"\b(_share_cuda_|rebuild_cuda_tensor|_new_shared_cuda)\b"),
                         "lorarl.platform.cuda_ipc"),
    "unpacked shared weights": (re.compile(r"dispatch_cpu_unquantized_gemm\s*="), "lorarl.rollout.vllm.shared_loader"),
    # a child that leaves with its starter: the mark is set and read in one place
    "parent-watch mark": (re.compile(r"LORARL_WATCH_PARENT"), "lorarl.common.parent_watch"),
    # the first hour (#46): a run's metric names (rollout/, train/, eval/, policy/; the three KLs) in one scheme,
    # and one walk over a config class's keys (the generated key reference and the resume check both use it)
    "metric names": (re.compile(r"[\"'](train/kl_ref|rollout/accuracy|eval/accuracy|train/entropy|"
                                r"rollout/reward_mean)[\"']"), "lorarl.client.rl.metric_names"),
    "config key walk": (re.compile(r"\bget_type_hints\("), "lorarl.common.config"),
    # teachers are adapters (#47 step 0): what a PEFT tensor is called and how its halves pair, the LoRA target
    # lists ("all-linear", attention-only, MLP-only, what is never a linear), the Qwen3 tool-call parser, and
    # the typed field every spec and section declares its keys with
    "PEFT tensor names": (re.compile(r"base_model\\?\.model|lora_[AB]\.weight|lora_\{\w+\}\.weight"),
                          "lorarl.contract.peft"),
    "PEFT files": (re.compile(r"[\"']adapter_(config\.json|model\.safetensors)[\"']"), "lorarl.contract.peft"),
    "all-linear": (re.compile(r"[\"']all-linear[\"'](?!\s*\S)|[\"']all-linear[\"']\s*[,)\]]"), "lorarl.contract.lora"),
    "LoRA target lists": (re.compile(r"[\"']q_proj[\"'],\s*[\"']k_proj[\"'],\s*[\"']v_proj[\"'],\s*[\"']o_proj|"
                                     r"[\"']gate_proj[\"'],\s*[\"']up_proj[\"'],\s*[\"']down_proj|"
                                     r"[\"']lm_head[\"'],\s*[\"']embed_tokens[\"']"), "lorarl.contract.lora"),
    "tool-call parser": (re.compile(r"re\.compile\(r?[\"']<tool_call>"), "lorarl.contract.tool_calls"),
    "typed field": (re.compile(r"^def setting\("), "lorarl.contract.fields"),
    # teachers are adapters (#47): the reverse-KL advantage in the loss, the one scorer of completions by teachers
    # (the rollout core's), and the trainer job a teacher is held as
    "distillation advantage": (re.compile(r"distill_scale\s*\*"), "lorarl.trainer.rl.losses"),
    "teacher scoring": (re.compile(r"\bteachers\.score\("), "lorarl.rollout.core"),
    "teacher job id": (re.compile(r"\.teacher\.\{"), "lorarl.client.job.inputs"),
    # full-model teachers (#47): whether two tokenizers read ids alike, the one client of a teacher's own engine
    # (made where the replica's token is known), and the name of that engine's process
    "token id mapping": (re.compile(r"\.get_vocab\("), "lorarl.contract.token_mapping"),
    "teacher engine client": (re.compile(r"\bTeacherEngines\("), "lorarl.rollout.server"),
    "teacher engine process": (re.compile(r"[\"']teacher-"), "lorarl.client.launch.local"),
    # agents distilled on the OpenAI endpoint (#47): the session and teacher headers the loop writes and the
    # endpoint reads, named once
    "agent session headers": (re.compile(r"[\"'](?i:x-session-id|x-lorarl-teachers)[\"']"),
                              "lorarl.contract.agent_sessions"),
    # a teacher that is another job's version (JOB@vN): one reader of a stored version outside the replicas
    "teacher from a job's version": (re.compile(r"(?<!def )\bfetch_version\("), "lorarl.client.rl.teacher_versions"),
    # the distillation example's data (#47): the mixed base's two domains in one dataset, built in one place from
    # the shipped splits
    "mixed-domain rows": (re.compile(r"DATA_DIR\s*/\s*[\"']mixed[\"']"), "lorarl.assets.mixed_task"),
    # a launcher a signal stopped leaves with its own exit code: one place decides, after its command returned
    "launcher exit after a signal": (re.compile(r"(?<!def )\bleave_if_signalled\("), "lorarl.client.cli"),
}


@pytest.mark.parametrize("concept", list(SINGLE_DEFINITIONS))
def test_one_definition_of_each_concept(concept: str) -> None:
    pattern, home = SINGLE_DEFINITIONS[concept]
    places = [f"{name}:{i}: {line.strip()}" for name, i, line in source_lines() if pattern.search(line)]
    assert places and all(p.startswith(f"{home}:") for p in places), places


def test_the_lora_defaults_are_the_contracts_everywhere() -> None:
    """The job file's section, an all-zero JobConfig.lora and the trainer's own spec mean the same LoRA."""
    from lorarl.client.job.config import LoraSection
    from lorarl.contract.lora import LoraSpec
    from lorarl.trainer.rl.lora import LoraConfig

    assert LoraSection().spec() == LoraSpec()
    assert LoraConfig.from_proto(common_pb2.LoraSpec()) == LoraConfig() == LoraConfig.from_proto(LoraSpec().to_proto())
    assert LoraSection(rank=4).spec() == LoraSpec(rank=4, alpha=8.0)
    assert LoraConfig.from_proto(common_pb2.LoraSpec(rank=4)) == LoraConfig(rank=4, alpha=8.0)


def test_weightsync_keeps_service_clients_and_wire_apart() -> None:
    """Every weight-sync module lives in one of its three packages (so the import rules above bind)."""
    names = [n for n in modules() if _under(n, "lorarl.weightsync") and n != "lorarl.weightsync"]
    assert names and all(n.split(".")[2] in ("wire", "client", "service") for n in names), names
    for client in ("publisher", "agent", "sinks", "activation"):
        assert f"lorarl.weightsync.client.{client}" in names


def test_trainer_modules_all_sit_in_a_layer() -> None:
    """Every trainer module lives in one of its four layers (so the layer rules above bind)."""
    names = [n for n in modules() if _under(n, "lorarl.trainer") and n != "lorarl.trainer"]
    assert names and all(n.split(".")[2] in ("rl", "engines", "ranks", "service") for n in names), names
    for module in ("rl.lora", "rl.losses", "engines.api", "engines.torch.engine", "ranks.group", "service.server"):
        assert f"lorarl.trainer.{module}" in names


def test_the_rollouts_client_helpers_import_no_rollout_internals() -> None:
    """lorarl.rollout.client is what other processes embed: it rests on the wire format only."""
    deps = import_graph()["lorarl.rollout.client"]
    assert deps and all(_under(d, "lorarl.weightsync.wire") or _under(d, "lorarl.contract")
                        or _under(d, "lorarl.common") for d in deps), deps


#: Request messages a core may take whole: documents it stores and relays as they are.
WIRE_DOCUMENTS = {"lorarl.weightsync.service.core": {"register_job", "subscribe"}}


@pytest.mark.parametrize("core", ["lorarl.trainer.service.jobs", "lorarl.rollout.core",
                                  "lorarl.weightsync.service.core"])
def test_the_cores_take_and_return_plain_data(core: str) -> None:
    """The servicers translate: no core method takes or returns a request or response message."""
    tree = ast.parse(modules()[core].read_text())
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
            annotations = [a.annotation for a in node.args.args if a.annotation is not None] + [node.returns]
            text = " ".join(ast.unparse(a) for a in annotations if a is not None)
            if re.search(r"_pb2\.\w+(Request|Response)\b", text) and node.name not in WIRE_DOCUMENTS.get(core, ()):
                offenders.append(f"{node.name}: {text}")
    assert offenders == []



#: Modules and torch.distributed calls that pickle what they send or unpickle what they receive.
PICKLE_MODULES = {"pickle", "cloudpickle", "dill", "shelve", "marshal"}
OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"}


def pickling(tree: ast.AST) -> list[str]:
    """What in ``tree`` pickles: imports of pickle modules, object collectives, torch.load without weights_only."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            found += [f"line {node.lineno}: import {n}" for n in names if n and n.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.Attribute) and node.attr in OBJECT_COLLECTIVES:
            found.append(f"line {node.lineno}: {node.attr}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords)
            found += [] if safe else [f"line {node.lineno}: torch.load without weights_only=True"]
    return found


def test_no_pickle_on_any_wire_or_file() -> None:
    """No module pickles: object collectives carry JSON or safetensors bytes (trainer/engines/plain_collectives.py)."""
    offenders = {name: hits for name, path in modules().items() if (hits := pickling(ast.parse(path.read_text())))}
    assert offenders == {}
    assert sorted(pickling(ast.parse("import pickle\ndist.all_gather_object(p, x)\ntorch.load(f)"))) == [
        "line 1: import pickle", "line 2: all_gather_object", "line 3: torch.load without weights_only=True"]


def test_the_contract_imports_only_the_platform_and_itself() -> None:
    """The contract is the floor every service and the Tinker front stand on (#47 step 0): besides the generated
    code it imports lorarl.platform alone, so a rule it states never depends on a service's helpers."""
    deps = {d for name, ds in import_graph().items() if _under(name, "lorarl.contract") for d in ds}
    outside = sorted(d for d in deps if not (_under(d, "lorarl.contract") or _under(d, "lorarl.platform")))
    assert deps and outside == []


def test_the_map_names_every_package() -> None:
    """docs/architecture.md has a row for each package of lorarl and each service's sub-package: the map a
    newcomer reads says what is there (it once had no row for the Tinker front)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    packages = sorted({path.parent.relative_to(ROOT).as_posix() for path in modules().values()})
    unnamed = []
    for package in packages:
        parts = package.split("/")
        ancestors = ["/".join(parts[:i]) for i in range(1, len(parts))]
        row_of_its_own = any(line.startswith(f"| `{package}/` |") for line in rows)
        named_in_an_ancestors_row = any(line.startswith(f"| `{a}/` |") and f"`{parts[-1]}/`" in line
                                        for a in ancestors for line in rows)
        if not (row_of_its_own or named_in_an_ancestors_row):
            unnamed.append(package)
    assert packages and unnamed == []


def _calls(tree: ast.AST, dotted: str) -> list[int]:
    """Lines calling ``dotted`` ("asyncio.run", "stop_on_sigterm") in ``tree``."""
    head, _, attr = dotted.rpartition(".")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (head and isinstance(f, ast.Attribute) and f.attr == attr and isinstance(f.value, ast.Name)
                    and f.value.id == head) or (not head and isinstance(f, ast.Name) and f.id == attr):
                found.append(node.lineno)
    return found


def test_a_launcher_that_stops_on_sigterm_runs_its_loop_through_run_interruptible() -> None:
    """A launcher that stops on SIGTERM as on Ctrl-C runs its event loop with lorarl.client.interrupt's
    run_interruptible, never asyncio.run: there the handler's KeyboardInterrupt lands inside whichever task
    runs, which printed a traceback (ci14) and exited 1 (stop 53's CI) instead of stopping in order."""
    offenders = {}
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        if _calls(tree, "stop_on_sigterm") and (lines := _calls(tree, "asyncio.run")):
            offenders[name] = lines
    assert offenders == {}
    assert _calls(ast.parse("stop_on_sigterm()\nasyncio.run(main())"), "asyncio.run") == [2]
    assert {"lorarl.client.commands.run", "lorarl.client.commands.evaluate"} <= {
        name for name, path in modules().items() if _calls(ast.parse(path.read_text()), "run_interruptible")}


def test_every_tinker_route_that_names_a_resource_acts_as_the_callers_tenant() -> None:
    """Tenants issue, item 2: each Tinker front route is either one of UNOWNED_ROUTES or hands its request to
    the tenant helpers (``caller``, ``new_model``, ``ordered``, ``in_model_order``), so a route added later cannot
    serve one tenant's models, samplers, paths or futures to another by forgetting the check (the e2e test in
    tests/e2e/test_tinker_rl_loop.py tries every such route with another tenant's ids)."""
    from lorarl.tinker.app import UNOWNED_ROUTES

    tree = ast.parse((ROOT / "lorarl/tinker/app.py").read_text())
    helpers = {"caller", "new_model", "ordered", "in_model_order"}
    routes, unchecked = set(), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef):
            continue
        for decorator in node.decorator_list:
            if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                    and decorator.func.attr in ("get", "post", "put", "delete")
                    and isinstance(decorator.args[0], ast.Constant)):
                route = f"{decorator.func.attr.upper()} {decorator.args[0].value}"
                routes.add(route)
                hands_over = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in helpers
                                 and c.args and isinstance(c.args[0], ast.Name) and c.args[0].id == "request"
                                 for c in ast.walk(node))
                if route not in UNOWNED_ROUTES and not hands_over:
                    unchecked.append(route)
    assert len(routes) >= 20 and routes >= UNOWNED_ROUTES and unchecked == []
