"""What Slurm says, read into plain facts: jobs from `squeue --json`, nodes from `sinfo --json`, gres strings,
slurm.conf's nodes (its Include files inlined), and whether a job opted in to be moved. Parsing only, shared by the
importer and the job side (collector) and the actuator (enforcer).

Only the JSON of openapi v0.0.38 (Slurm 22.05) is read: another version's fields differ in shape (23.02 gives
`job_state` as a list and times as objects), so it is refused with a message rather than half understood.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store.errors import InvalidInput, UpstreamUnavailable

log = logging.getLogger(__name__)

SUPPORTED_PLUGINS = ("openapi/v0.0.38",)
GPU_KINDS = ("gpu", "shard")
OPT_IN_WORD = "fleetlens:movable"  # in a job's --comment: the owner lets fleetlens requeue it into fewer shards
# the other way to opt in: the job's fleetlens SDK says so in its start mark (store.slurm_marks)
SDK_OPT_IN = "FLEETLENS_MOVABLE=true or collector.job.job(movable=True)"
# the first Slurm that can change a job's request from whole GPUs to shards (upstream commit fd6efe3e64)
GPU_TO_SHARD_VERSION = "23.02.6"

# a GPU type may start with a digit (MIG profiles: gpu:1g.5gb:7), but is never a bare number (gpu:4 is a count)
_GRES = re.compile(r"^(?:gres:)?(?P<kind>[A-Za-z_][\w-]*)(?::(?P<type>(?!\d+(?::|$))[\w.-]+))?(?::(?P<count>\d+))?$")
# what a job asked for, by how it asked: --gres (per node), --gpus (per job), --gpus-per-task
REQUEST_FIELDS = ("tres_per_node", "tres_per_job", "tres_per_task")
# the states in which a job holds its allocation: running, and the flag states Slurm shows in front of it
# (job_state_string: a stopped, signalled, resized or staging-out job keeps its GPUs)
HOLDING_STATES = ("RUNNING", "COMPLETING", "SUSPENDED", "CONFIGURING", "STOPPED", "SIGNALING", "RESIZING",
                  "STAGE_OUT")
# the states of a job that waits to run (again): pending, or on its way back to pending after a requeue
# (SPECIAL_EXIT: requeued and held after its special exit code; RESV_DEL_HOLD: held as its reservation was deleted)
WAITING_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD")
_DETAIL = re.compile(r"^(?P<gres>[^()]+?)(?:\(IDX:(?P<idx>[^)]*)\))?$")


@dataclass(frozen=True)
class Gres:
    """One generic-resource request: `kind` gpu or shard, an optional GPU type, and a count."""

    kind: str
    count: int
    type: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}:{self.type}:{self.count}" if self.type else f"{self.kind}:{self.count}"


def parse_gres(text: str) -> Gres | None:
    """The GPU request in a gres string ("gres:shard:2", "gpu:a100:1", "gres:gpu"); None for no request at all.
    Raises InvalidInput for anything else: fleetlens must not guess what a job holds."""
    text = (text or "").strip()
    if not text or text == "(null)":
        return None
    parts = [p for p in text.split(",") if p]
    found: list[Gres] = []
    for part in parts:
        m = _GRES.match(part.strip())
        if m is None:
            raise InvalidInput(f"cannot read the gres {text!r}: expected kind[:type][:count], like shard:2 or "
                               "gpu:a100:1")
        if m["kind"] not in GPU_KINDS:
            raise InvalidInput(f"gres {text!r} asks for {m['kind']!r}, which fleetlens does not understand (it reads "
                               f"{' and '.join(GPU_KINDS)} only); the job is observed without its GPUs and never moved")
        found.append(Gres(kind=m["kind"], type=m["type"], count=int(m["count"] or 1)))
    if len(found) > 1:
        raise InvalidInput(f"gres {text!r} asks for both whole GPUs and shards; fleetlens reads one kind per job")
    return found[0]


def parse_indices(text: str) -> list[int]:
    """GPU indices from Slurm's "0-1,3" notation."""
    out: list[int] = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part or part == "N/A":
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise InvalidInput(f"cannot read the GPU indices {text!r} (expected a list like 0-1,3)")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def held_indices(gres_detail: list[str]) -> list[int]:
    """The GPUs a job holds, from squeue's gres_detail (["shard:1(IDX:0)"], ["gpu:2(IDX:0-1)"]), all its nodes' run
    together: right for a job on one node only (`held_by_node` keeps them apart)."""
    found: set[int] = set()
    for item in gres_detail or []:
        found.update(_detail_indices(item))
    return sorted(found)


def _detail_indices(item: str | None) -> list[int]:
    """The GPU indices of one node's gres_detail entry (null or empty: a node of the job that holds no GPU)."""
    if not item or not item.strip():
        return []
    m = _DETAIL.match(item.strip())
    if m is None:
        raise InvalidInput(f"cannot read squeue's gres_detail {item!r}")
    gres = parse_gres(m["gres"])
    return parse_indices(m["idx"]) if gres is not None and m["idx"] is not None else []


def held_by_node(nodes: list[str], gres_detail: list[str | None]) -> dict[str, tuple[int, ...]]:
    """{node: the GPU indices the job holds on it}, from squeue's gres_detail, which has one entry per node of the job
    in the order of its node list (`nodes`, expanded). The indices are each node's own: GPU 0 of gpu01 and GPU 0 of
    gpu02 are two GPUs. Raises InvalidInput when the entries do not match the nodes one for one (fleetlens must not
    guess which node holds which GPU)."""
    detail = list(gres_detail or [])
    if not detail:
        return {}
    if len(detail) != len(nodes):
        raise InvalidInput(f"squeue's gres_detail has {len(detail)} entries for the job's {len(nodes)} node(s) "
                           f"({','.join(nodes) or 'none'}); cannot tell which node holds which GPU")
    held = {node: tuple(sorted(set(_detail_indices(item)))) for node, item in zip(nodes, detail, strict=True)}
    return {node: indices for node, indices in held.items() if indices}


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    name: str | None
    user: str | None
    account: str | None
    partition: str | None
    state: str
    reason: str | None
    node: str | None
    submit_time: float
    time_limit_s: float | None
    gres: Gres | None
    gres_error: str | None
    gpu_indices: tuple[int, ...]
    requeue: bool
    restart_count: int
    comment: str | None
    opted_in: bool = False
    not_movable_reason: str | None = None
    # every node the job runs on (its node list, expanded; `node` is the one that runs its batch script) and the GPU
    # indices it holds on each: `gpu_indices` are `node`'s alone, the whole of them for a job on one node
    nodes: tuple[str, ...] = ()
    gpus_by_node: dict[str, tuple[int, ...]] = field(default_factory=dict)
    start_time: float | None = None  # when its current run began (squeue's start_time), while it holds its GPUs

    def __post_init__(self) -> None:
        # a job made with only `node` and `gpu_indices` (code written before jobs had several nodes) is on that node
        if not self.nodes and self.node:
            object.__setattr__(self, "nodes", (self.node,))
        if not self.gpus_by_node and self.node and self.gpu_indices:
            object.__setattr__(self, "gpus_by_node", {self.node: tuple(self.gpu_indices)})

    @property
    def workflow_id(self) -> str:
        return workflow_id_of(self.job_id)

    def gpus_on(self, node: str) -> tuple[int, ...]:
        """The GPU indices the job holds on `node` (none on a node it does not run on)."""
        return self.gpus_by_node.get(node, ())

    @property
    def gpus_held(self) -> int:
        """How many GPUs the job holds on all its nodes together (shared or whole)."""
        return sum(len(indices) for indices in self.gpus_by_node.values())


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str  # the base state, as sinfo --json gives it (idle, mixed, allocated, down, ...)
    partitions: tuple[str, ...]
    gpus: int
    shards: int
    flags: tuple[str, ...] = ()  # its state flags (DRAIN, NOT_RESPONDING, FAIL, MAINTENANCE, ...: store.slurm_nodes)
    reason: str | None = None  # why an admin or Slurm drained it or set it down

    def shards_on(self, index: int) -> int:
        """The shards GPU `index` of the node has (Slurm's spread: `shards_by_gpu`)."""
        spread = shards_by_gpu(self.gpus, self.shards)
        return spread[index] if 0 <= index < len(spread) else 0

    @property
    def finest_shards(self) -> int:
        """The most shards any one GPU of the node has: the smallest share one shard can be."""
        return finest_shards(self.gpus, self.shards)


def shards_by_gpu(gpus: int, shards: int) -> tuple[int, ...]:
    """How Slurm spreads a node's `shard` count over its GPUs when gres.conf gives the shards no File=: each GPU gets
    shards // gpus, and the last shards % gpus GPUs one more (measured on Slurm 22.05: 6 shards on 4 GPUs are 1, 1,
    2, 2; 3 on 4 are 0, 1, 1, 1). Shard lines with File= of their own may spread them otherwise; fleetlens does not
    read gres.conf."""
    if gpus <= 0:
        return ()
    base, extra = divmod(max(0, shards), gpus)
    return tuple(base + (1 if i >= gpus - extra else 0) for i in range(gpus))


def finest_shards(gpus: int, shards: int) -> int:
    """The most shards any one GPU of a node with `gpus` GPUs and `shards` shards has (0: none)."""
    return max(shards_by_gpu(gpus, shards), default=0)


@dataclass
class SlurmView:
    """One reading of the cluster: its version, its nodes, its jobs."""

    version: str
    nodes: dict[str, SlurmNode] = field(default_factory=dict)
    jobs: dict[int, SlurmJob] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # nodes left out, and why


def workflow_id_of(job_id: int) -> str:
    """The workflow id of a Slurm job: the agent gives the job's processes the same one (SLURM_JOB_ID)."""
    return f"slurm-{job_id}"


def version_of(doc: dict[str, Any], what: str) -> str:
    """The Slurm release that wrote `doc`; raises InvalidInput for a JSON this module cannot read."""
    if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict):
        raise InvalidInput(f"{what} did not print Slurm's JSON (no 'meta' object); is this Slurm's {what}?")
    plugin = (doc["meta"].get("plugin") or {}).get("type")
    release = ((doc["meta"].get("Slurm") or {}).get("release")) or "an unknown release"
    if plugin not in SUPPORTED_PLUGINS:
        raise InvalidInput(f"{what} printed JSON of {plugin or 'an unnamed plugin'} (Slurm {release}); fleetlens "
                           f"reads {', '.join(SUPPORTED_PLUGINS)} (Slurm 22.05) only, and refuses to guess the "
                           "fields of another version")
    errors = doc.get("errors") or []
    if errors:  # squeue --json exits 0 with an empty job list and this when slurmctld does not answer
        said = "; ".join(f"{e.get('source', '?')}: {e.get('description') or e.get('error')}" for e in errors
                         if isinstance(e, dict)) or str(errors)
        raise UpstreamUnavailable(f"{what} could not read the cluster ({said}); is slurmctld up?")
    return str(release)


def opt_in(comment: str | None, requeue: bool, gres: Gres | None, gres_error: str | None, *,
           sdk_asked: bool = False, nodes: int = 1) -> tuple[bool, str | None]:
    """(whether the job may be moved, and if not, why it is observed and advised only). The one place the rule
    lives: the job asked (its --comment says OPT_IN_WORD, or its fleetlens SDK said so in its start mark:
    `sdk_asked`), Slurm may requeue it, it holds shards, and it runs on one node (`nodes`: a move sizes, signals and
    checks one node's shards and one batch step)."""
    by_comment = OPT_IN_WORD in (comment or "").split()
    if not by_comment and not sdk_asked:
        return False, (f"did not opt in (its --comment has no {OPT_IN_WORD!r}, and its fleetlens SDK did not ask to "
                       f"be movable: {SDK_OPT_IN})")
    how = "opted in (by its --comment)" if by_comment else "opted in (by its fleetlens SDK)"
    if not requeue:
        return False, f"{how}, but Slurm may not requeue it (submitted with --no-requeue)"
    if nodes > 1:
        return False, (f"{how}, but it runs on {nodes} nodes: fleetlens moves jobs on one node only (a move sizes "
                       "and checks one node's shards, and the checkpoint signal reaches one batch step)")
    if gres_error is not None:
        return False, f"{how}, but its gres cannot be read: {gres_error}"
    if gres is None:
        return False, f"{how}, but it holds no GPU"
    if gres.kind == "gpu":
        return False, (f"{how}, but it asked for whole GPUs ({gres}): Slurm before {GPU_TO_SHARD_VERSION} cannot "
                       "change such a request to shards; submit it with --gres=shard:N to let fleetlens move it")
    return True, None


def _epoch(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and value > 0 else None


# (job id, submit time, restart count) -> whether the job's fleetlens SDK asked to be movable (store.slurm_marks)
SdkAsked = Callable[[int, float, int], bool]


def parse_jobs(doc: dict[str, Any], *, sdk_asked: SdkAsked | None = None) -> tuple[str, dict[int, SlurmJob]]:
    """(Slurm release, {job id: job}) from `squeue --json`. `sdk_asked` is consulted for the jobs whose comment does
    not opt them in (without it, only the comment counts: the view of code that does not decide on moves)."""
    release = version_of(doc, "squeue --json")
    jobs: dict[int, SlurmJob] = {}
    for raw in doc.get("jobs") or []:
        try:
            job_id, state = int(raw["job_id"]), str(raw["job_state"])
        except (KeyError, TypeError, ValueError):
            raise InvalidInput(f"squeue --json gave a job without a job_id or job_state: {str(raw)[:200]}") from None
        gres: Gres | None = None
        gres_error: str | None = None
        batch_host = (raw.get("batch_host") or None) if state != "PENDING" else None
        try:
            nodes = expand_hostlist(str(raw.get("nodes") or "")) if state != "PENDING" else []
        except InvalidInput as exc:
            nodes, gres_error = [], f"its node list: {exc}"
        if not nodes and batch_host:
            nodes = [batch_host]
        node = batch_host if batch_host in nodes else (nodes[0] if nodes else None)
        by_node: dict[str, tuple[int, ...]] = {}
        try:
            gres = parse_gres(next((str(raw[f]) for f in REQUEST_FIELDS if raw.get(f)), ""))
            if gres_error is None:
                by_node = held_by_node(nodes, raw.get("gres_detail") or [])
        except InvalidInput as exc:
            gres_error = str(exc)
        requeue = bool(raw.get("requeue"))
        comment = raw.get("comment") or None
        submit_time = _epoch(raw.get("submit_time")) or 0.0
        restart_count = int(raw.get("restart_cnt") or 0)
        asked = (sdk_asked is not None and OPT_IN_WORD not in (comment or "").split()
                 and sdk_asked(job_id, submit_time, restart_count))
        ok, why = opt_in(comment, requeue, gres, gres_error, sdk_asked=asked, nodes=len(nodes))
        limit = raw.get("time_limit")
        jobs[job_id] = SlurmJob(
            job_id=job_id, name=raw.get("name") or None, user=raw.get("user_name") or None,
            account=raw.get("account") or None, partition=raw.get("partition") or None, state=state,
            reason=None if raw.get("state_reason") in (None, "", "None") else str(raw["state_reason"]),
            node=node, submit_time=submit_time,
            time_limit_s=float(limit) * 60.0 if isinstance(limit, int | float) and limit > 0 else None,
            gres=gres, gres_error=gres_error, gpu_indices=by_node.get(node or "", ()), requeue=requeue,
            restart_count=restart_count, comment=comment, opted_in=ok, not_movable_reason=why, nodes=tuple(nodes),
            gpus_by_node=by_node,
            # squeue's start_time of a pending job is when Slurm expects to start it, not a start; a job COMPLETING
            # after a requeue still shows its old run's
            start_time=_epoch(raw.get("start_time")) if state in HOLDING_STATES else None)
    return release, jobs


def gres_counts(text: str, what: str) -> tuple[int, int]:
    """(GPUs, shards) a node has, from its gres ("gpu:4,shard:8", "gpu:a100:4(S:0),shard:8"); other kinds are not
    counted. The commas inside a part's parentheses ("gpu:4(S:0,2)": GPUs bound to sockets 0 and 2) are not parts'
    separators. Raises InvalidInput for a part it cannot read."""
    gpus = shards = 0
    for part in _split_top(text, what=text, brackets="()", kind=what):
        part = part.split("(")[0].strip()
        if not part or part == "(null)":
            continue
        m = _GRES.match(part)
        if m is None:
            raise InvalidInput(f"cannot read {what} {text!r}")
        if m["kind"] == "gpu":
            gpus += int(m["count"] or 1)
        elif m["kind"] == "shard":
            shards += int(m["count"] or 1)
    return gpus, shards


def parse_nodes(doc: dict[str, Any], *, errors: list[str] | None = None) -> tuple[str, dict[str, SlurmNode]]:
    """(Slurm release, {node name: node}) from `sinfo --json`. A node whose gres cannot be read is left out (fleetlens
    must not guess its GPUs), with the reason appended to `errors` (logged when there is no such list); the other
    nodes are read."""
    release = version_of(doc, "sinfo --json")
    nodes: dict[str, SlurmNode] = {}
    for raw in doc.get("nodes") or []:
        name = raw.get("name")
        if not name:
            raise InvalidInput(f"sinfo --json gave a node without a name: {str(raw)[:200]}")
        try:
            gpus, shards = gres_counts(str(raw.get("gres") or ""), f"node {name}'s gres")
        except InvalidInput as exc:
            why = f"slurm node {name} left out: {exc}; its GPUs and the jobs' placements on it are not recorded"
            if errors is not None:
                errors.append(why)  # the caller reports it
            else:
                log.warning("%s", why)
            continue
        nodes[name] = SlurmNode(name=name, state=str(raw.get("state") or "unknown"),
                                partitions=tuple(raw.get("partitions") or ()), gpus=gpus, shards=shards,
                                flags=tuple(str(f) for f in raw.get("state_flags") or ()),
                                reason=str(raw["reason"]) if raw.get("reason") else None)
    return release, nodes


def free_shards(node: SlurmNode, jobs: dict[int, SlurmJob], *, leaving: int | None = None) -> dict[int, int]:
    """{GPU index: shards free on it} for the node's GPUs that no whole-GPU job holds, counting the running jobs'
    shards (`leaving`: a job whose own shards count as free, as after it is held)."""
    used = {i: 0 for i in range(node.gpus)}
    whole: set[int] = set()
    for job in jobs.values():
        held = job.gpus_on(node.name)  # a job on several nodes holds GPUs on each of them
        if not held or job.state not in HOLDING_STATES or job.job_id == leaving:
            continue
        if job.gres is not None and job.gres.kind == "gpu":
            whole.update(held)
        elif job.gres is not None and job.gres.kind == "shard":
            per = max(1, len(held))  # a shard request is per node (--gres)
            for i in held:
                used[i] = used.get(i, 0) + job.gres.count // per
    return {i: node.shards_on(i) - n for i, n in used.items() if i not in whole}


def shard_share(shards: int, gpus_held: int, shards_of_gpu: int) -> float:
    """The share of a GPU split into `shards_of_gpu` shards that a job on `shards` shards spread over `gpus_held`
    GPUs holds (at most 1)."""
    return min(1.0, shards / max(1, gpus_held) / shards_of_gpu)


def expand_hostlist(text: str) -> list[str]:
    """Slurm's host list notation as names: "n[01-03,07],gpu5" and, with several bracket groups in one name, every
    combination of them in Slurm's order ("rack[1-2]-n[01-02]": rack1-n01, rack1-n02, rack2-n01, rack2-n02). Raises
    InvalidInput for brackets that do not pair up or a range that is not numbers."""
    names: list[str] = []
    for part in _split_top(text, what=text):
        if part:
            names.extend(_expand_name(part, text))
    return names


def _split_top(text: str, *, what: str, brackets: str = "[]", kind: str = "the host list") -> list[str]:
    """`text` split at the commas outside brackets (`brackets`: the opening and the closing one)."""
    opening, closing = brackets
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == opening:
            depth += 1
            if depth > 1:
                raise InvalidInput(f"cannot read {kind} {what!r}: a bracket inside a bracket")
        elif ch == closing:
            depth -= 1
            if depth < 0:
                raise InvalidInput(f"cannot read {kind} {what!r}: a {closing!r} without its {opening!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise InvalidInput(f"cannot read {kind} {what!r}: a {opening!r} without its {closing!r}")
    parts.append(text[start:].strip())
    return parts


def _expand_name(name: str, what: str) -> list[str]:
    """One name with any number of bracket groups, the first group varying slowest."""
    m = re.match(r"(?P<pre>[^\[]*)\[(?P<ranges>[^\]]*)\](?P<rest>.*)", name)
    if m is None:
        return [name]
    heads: list[str] = []
    for r in m["ranges"].split(","):
        lo, _, hi = r.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or int(hi or lo) < int(lo):
            raise InvalidInput(f"cannot read the host list {what!r}: {r!r} is not a range like 01-03")
        heads.extend(f"{m['pre']}{i:0{len(lo)}d}" for i in range(int(lo), int(hi or lo) + 1))
    tails = _expand_name(m["rest"], what)
    return [head + tail for head in heads for tail in tails]


MAX_INCLUDE_DEPTH = 16


def read_slurm_conf(path: Path) -> str:
    """slurm.conf's text with its `Include` lines replaced by the files they name, as Slurm reads it: a line that
    begins with the word Include (any case) and a file name; a relative name is looked up beside the top slurm.conf;
    `%c` stands for the ClusterName set above the line. OSError when a file cannot be read; InvalidInput for an
    Include with no file name, or includes nested deeper than MAX_INCLUDE_DEPTH (a loop)."""
    cluster = ""

    def read(file: Path, depth: int) -> list[str]:
        nonlocal cluster
        if depth > MAX_INCLUDE_DEPTH:
            raise InvalidInput(f"slurm.conf: Include nested more than {MAX_INCLUDE_DEPTH} deep at {file} (a loop?)")
        out: list[str] = []
        for line in file.read_text().splitlines():
            content = line.split("#", 1)[0]
            words = content.split(None, 1)
            if words and words[0].lower() == "include":
                if len(words) < 2:
                    raise InvalidInput(f"slurm.conf: an Include line with no file name in {file}")
                name = Path(words[1].strip().replace("%c", cluster))
                out.extend(read(name if name.is_absolute() else path.parent / name, depth + 1))
                continue
            if m := re.search(r"(?i)(?:^|\s)ClusterName=(\S+)", content):
                cluster = m[1]
            out.append(line)
        return out

    return "\n".join(read(path, 0))


def conf_node_gres(conf: str, node: str) -> tuple[int, int] | None:
    """(GPUs, shards) slurm.conf's NodeName lines give `node` (NodeName=DEFAULT lines count as its defaults); None
    when no line names it. Raises InvalidInput for a Gres= or host list it cannot read."""
    default: str | None = None
    found: str | None = None
    for line in conf.splitlines():
        words = dict(w.split("=", 1) for w in line.split("#", 1)[0].split() if "=" in w)
        words = {k.lower(): v for k, v in words.items()}
        if "nodename" not in words:
            continue
        if words["nodename"].upper() == "DEFAULT":
            default = words.get("gres", default)
        elif node in expand_hostlist(words["nodename"]):
            found = words.get("gres", default) or ""
    return None if found is None else gres_counts(found, f"slurm.conf's Gres= of node {node}")
