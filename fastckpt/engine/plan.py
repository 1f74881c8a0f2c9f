"""The save plan: which rank writes which chunk, agreed from one small exchange per save.

(all ranks, training thread) Each rank lists its chunks (``chunks.local_chunks``: a box of
a global tensor per DTensor shard or whole regular tensor) and sends rank 0 alone
(``Group.decide``, :class:`PlanExchange`) a 128-bit hash of that layout and one hash of the
content fingerprints of its replicated tensors that other ranks hold too. Rank 0 answers
every rank with one verdict: **reuse** when every layout hash is the one that rank sent at the
previous exchange and no such tensor differs now between its holders (the common case: the
chunk layout of a training state does not change between saves; nobody parses N chunk lists
or runs ``make_plan``, and the store moves O(N) bytes), else **exchange**: every rank sends
rank 0 alone (the first save, a changed layout) what rank 0 cannot know: not its DTensor
boxes whose holders follow from the mesh (``ChunkSpec.solo``: its own, or elected among
replicas), only their table, and no table or list that is rank 0's (``None``) or that the
verdict names another rank to send (``own_as``, ``specs_as``: the first rank of each other
pipeline stage sends its stage's). Rank 0 computes the plan once (``make_plans``): the save
id (rank 0's proposal), dtype/shape agreement, and the writer of each other chunk (a chunk
several ranks hold is written once, by the least-loaded holder, largest chunks first); each
rank receives only its own part (``Group.decide(..., each=True)``).
The plain-value skeletons are not part of the exchange: each rank sends its own to the
coordinator with its commit result (fastckpt/engine/writer.py).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
from dataclasses import dataclass

from ..errors import UnsupportedStateError
from .chunks import ChunkSpec, digest, local_chunks  # noqa: F401 - (what callers import here)
from .solo import check_held, solo_of, written, writes


@dataclass(frozen=True)
class SavePlan:
    save_id: str
    step: int
    world_size: int
    my_chunks: tuple  # ChunkSpecs this rank writes, in key order
    tensors: dict  # fqn -> {"dtype", "shape", "dtensor"}: on the coordinator; {} elsewhere
    tree: object = None  # this rank's skeleton (sent to the coordinator with its result)
    pieces: tuple = ()  # this rank's shard files (staging.Piece), set by Checkpointer.save
    #: 2 when the manifest uses what format 1 readers do not know (ties, per-rank tensors)
    format_version: int = 1
    #: each rank writes its chunk list to its own index file (format 4; rank 0 decides:
    #: ``CheckpointOptions.rank_indexes``)
    indexed: bool = False
    #: every rank's skeleton is rank 0's (their hashes agreed): only rank 0 sends it
    same_tree: bool = False

    @property
    def file_size(self) -> int:
        """Bytes this rank writes, over all its shard files."""
        return sum(p.size for p in self.pieces)


def make_plans(values: list[dict], step: int) -> tuple[list[list], SavePlan]:
    """(the coordinator) The global plan from everyone's chunk lists, computed once: per rank,
    the spec rows (JSON lists, fingerprints dropped) of the chunks rank 0 assigns it, in key
    order; and rank 0's own :class:`SavePlan` (with the tensor table only the coordinator
    needs). A rank's chunks that it alone holds (``ChunkSpec.solo``) are not in its list, only
    in its table (``own``: fqn, dtype, shape, mesh) and its byte count (``own_bytes``): it
    writes them itself (:meth:`PlanExchange.take`). A list or table that is ``None`` is rank
    0's (the rank's hash of it was rank 0's): rank 0 plans such a group of ranks from one list,
    O(K + N log N) where parsing every rank's list was O(N K).

    A regular tensor whose content differs between the ranks holding it (an RNG state, a
    per-rank buffer) is per rank: every holder writes its own and loads its own back. Every
    other chunk is written once: a chunk only one rank holds (a DTensor shard) by that rank; a
    chunk several hold, largest first, by the least-loaded holder once the single-holder bytes
    are counted."""
    raise_state_errors(values)
    n = len(values)
    metas: dict[str, tuple] = {}

    def meet(fqn: str, meta: tuple, r: int) -> None:
        prev = metas.setdefault(fqn, meta)
        if prev != meta:
            raise UnsupportedStateError(
                f"ranks disagree on tensor {fqn!r}: {_meta(prev)} on an earlier rank, "
                f"{_meta(meta)} on rank {r}")
    meshes: dict[str, tuple] = {}  # fqn -> (the mesh and placements of its shards, a rank)
    for r, v in enumerate(values):
        if v.get("own") is None and v.get("own_as") is not None:
            a = v["own_as"]  # (a table another rank sent: met there)
            if not (0 < a < n and values[a].get("own") is not None):
                raise UnsupportedStateError(f"rank {r} names rank {a}'s table, not sent")
            continue
        for fqn, dtype, shape, mesh in (v.get("own", []) if r == 0 else v.get("own") or ()):
            meet(fqn, (dtype, tuple(shape), True), r)
            if meshes.setdefault(fqn, (mesh, r))[0] != mesh:
                raise UnsupportedStateError(
                    f"tensor {fqn!r} is sharded over another device mesh or placements on rank "
                    f"{r} than on rank {meshes[fqn][1]}")
    check_held(values)
    lead = _leads(values)  # whose list stands for each rank's
    members: dict = {}  # a rank that sent a list -> the ranks it stands for
    for r in range(n):
        members.setdefault(lead[r], []).append(r)
    spec: dict = {}  # key -> the first holder's row
    holding: dict = {}  # key -> the ranks that sent a list holding it, in rank order
    digests: dict = {}
    mine: dict = {}  # a rank that sent a list -> key -> row
    for a in members:
        rows: dict = {}
        for s in values[a]["specs"]:  # [fqn, dtype, shape, offsets, sizes, nbytes, dtensor, digest]
            meet(s[0], (s[1], tuple(s[2]), s[6]), a)
            if s[5] and s[0] in meshes:
                raise UnsupportedStateError(
                    f"tensor {s[0]!r}: rank {a} holds a box of it that rank "
                    f"{meshes[s[0]][1]}'s device mesh gives to one rank alone")
            key = (s[0], tuple(s[3]))
            rows[key] = s
            if key in spec:
                digests[key].add(s[7])
                holding[key].append(a)
            else:
                spec[key], digests[key], holding[key] = s, {s[7]}, [a]
        mine[a] = rows
    if any(values[r].get("differ") for r in members[0]):
        order = list(mine[0])  # (rank 0's list, in its order: the places ``differ`` names)
        for r in members[0]:
            for i, d in values[r].get("differ") or ():
                digests[order[i]].add(d)
    for r, v in enumerate(values):
        if v.get("digests_as") is not None:  # its fingerprints, in its list's (= lead's) order
            rows = mine[lead[r]]
            if lead[r] == r or len(v["digests_as"]) != len(rows):
                raise UnsupportedStateError(
                    f"rank {r}'s fingerprints do not match rank {lead[r]}'s chunk list")
            for (key, row), d in zip(rows.items(), v["digests_as"]):
                if d != row[7]:
                    digests[key].add(d)
    per_rank = {key for key, ds in digests.items() if len(ds) > 1}
    tensors = {fqn: _meta(m) for fqn, m in metas.items()}
    for fqn, _ in per_rank:
        tensors[fqn]["per_rank"] = True
    chunks: list[list] = [[] for _ in range(n)]
    load = [v.get("own_bytes", 0) for v in values]
    shared = []
    for key, hs in holding.items():
        if key in per_rank:
            for a in hs:
                for r in members[a]:
                    chunks[r].append(key)
        elif len(hs) == 1 and len(members[hs[0]]) == 1:
            chunks[hs[0]].append(key)
            load[hs[0]] += spec[key][5]
        else:
            shared.append(key)
    # the loads of the ranks one list stands for, in a heap: a rank of such a group changes
    # load only here (O(log N) per chunk, not O(N))
    heaps = {a: [(load[r], r) for r in rs] for a, rs in members.items() if len(rs) > 1}
    for h in heaps.values():
        heapq.heapify(h)
    for key in sorted(shared, key=lambda k: (-spec[k][5], k[0], k[1])):
        best = None
        for a in holding[key]:
            cand = heaps[a][0] if a in heaps else (load[a], a)
            if best is None or cand < best:
                best, group = cand, a
        w = best[1]
        load[w] += mine[lead[w]][key][5]
        if group in heaps:
            heapq.heapreplace(heaps[group], (load[w], w))
        chunks[w].append(key)
    # (the fingerprints served the split above; a reused plan must not carry stale ones)
    rows = [[list(mine[lead[r]][k][:7]) + [None] for k in sorted(chunks[r])]
            for r in range(n)]
    v2 = bool(per_rank) or any(g.get("aliases") for g in values)
    plan = SavePlan(save_id=values[0]["save_id"], step=step, world_size=n,
                    my_chunks=_chunk_specs(rows[0]), tensors=tensors,
                    format_version=2 if v2 else 1)
    return rows, plan


def _leads(values: list[dict]) -> list[int]:
    """(rank 0) Per rank, the rank whose list stands for its own: itself when it sent one, 0
    when it sent None (rank 0's), the rank it names when it sent another's (``specs_as``)."""
    lead = list(range(len(values)))
    for r, v in enumerate(values):
        if r and v["specs"] is None:
            a = v.get("specs_as")
            if a is not None and not (0 < a < len(values) and values[a]["specs"] is not None):
                raise UnsupportedStateError(f"rank {r} names rank {a}'s chunk list, not sent")
            lead[r] = 0 if a is None else a
    return lead


def _meta(m: tuple) -> dict:
    return {"dtype": m[0], "shape": list(m[1]), "dtensor": m[2]}


def _chunk_specs(rows: list) -> tuple:
    return tuple(ChunkSpec(s[0], s[1], tuple(s[2]), tuple(s[3]), tuple(s[4]), s[5], s[6])
                 for s in rows)


def make_plan(gathered: list[dict], rank: int, step: int) -> SavePlan:
    """One rank's plan as :func:`make_plans` makes it (tests, benchmarks: the engine has the
    coordinator compute it once and send each rank its part, ``PlanExchange.assign``)."""
    rows, plan = make_plans(gathered, step)
    return dataclasses.replace(plan, my_chunks=_chunk_specs(rows[rank]))


def state_errors(values: list[dict]) -> str | None:
    """The message naming the ranks that could not list their state, or None."""
    errors = [(r, g["error"]) for r, g in enumerate(values) if g["error"]]
    if not errors:
        return None
    r, msg = errors[0]
    more = f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""
    return f"rank {r} cannot save its state: {msg}{more}"


def raise_state_errors(gathered: list[dict]) -> None:
    """(all ranks, after an exchange) Raise if a rank could not list its state, naming it."""
    msg = state_errors(gathered)
    if msg is not None:
        raise UnsupportedStateError(msg)


def layout_hash(specs: list) -> str:
    """A 128-bit hash of a rank's chunk layout: its specs without the content fingerprints."""
    import xxhash
    return xxhash.xxh3_128_hexdigest(json.dumps([list(s[:7]) for s in specs]).encode())


def _merge(rows: list, solo: list) -> list:
    """The rows rank 0 assigned a rank and the rows of the chunks it alone holds, in key order
    (the order :func:`make_plans` gives)."""
    return sorted(rows + solo, key=lambda s: (s[0], tuple(s[3]))) if solo else rows


def _joint_hash(digests: list) -> str:
    import xxhash
    return xxhash.xxh3_128_hexdigest(json.dumps(digests).encode())


@dataclass
class _Reusable:
    """What a full exchange leaves for the saves after it: the same on every rank that took
    part (each computes it from the same gathered lists)."""
    base: str  # the save id of the last exchange or reuse this rank took part in
    plan: SavePlan  # this rank's plan
    hashes: list  # (rank 0) per rank: its layout hash
    #: per rank: (the places in its regular-tensor fingerprints, the keys) of its replicated
    #: tensors that other ranks hold too: what must still agree for the plan to hold
    watch: list
    mine: list  # this rank's places of those
    #: per rank: the group of ranks holding exactly the same such tensors (None: hold none)
    group: list
    #: the values carry one hash of the watched fingerprints (every shared replicated tensor's
    #: holders are one group), else every regular tensor's fingerprint
    compact: bool


def _alike(values: list[dict]) -> bool:
    """Whether every rank's table of solo boxes was rank 0's (sent as None)."""
    return all(v.get("own", ()) is None and v.get("own_as") is None for v in values[1:])


#: at most this many tables are named in a verdict (:func:`_senders`): it goes to every rank
SENDERS_MAX = 64


def _list_hash(rest: list) -> str:
    """The hash of a rank's list of non-solo chunks with their fingerprints."""
    return _joint_hash([list(s[:8]) for s in rest])


def _senders(values: list[dict], field: str, zero: str) -> dict:
    """(rank 0) For each table of solo boxes (``field`` "own_hash") or layout of the list of
    the other chunks ("rest_hash") that several ranks hold and rank 0 does not (a pipeline
    stage's, under PP + FSDP), the first rank holding it: only that rank sends it, the others
    name it (``own_as``, ``specs_as``; a list whose fingerprints differ from that rank's, a
    per-rank RNG state, with its fingerprints alone: ``digests_as``): rank 0 receives one per
    stage, not one per rank. The SENDERS_MAX most shared (the verdict goes to every rank);
    other ranks send theirs."""
    first: dict = {}
    count: dict = {}
    for r, v in enumerate(values):
        h = v.get(field)
        if h is not None and h != zero:
            first.setdefault(h, r)
            count[h] = count.get(h, 0) + 1
    shared = sorted((h for h, c in count.items() if c > 1), key=lambda h: (-count[h], h))
    return {h: first[h] for h in shared[:SENDERS_MAX]}


def _same_tree(values: list[dict]) -> bool:
    """Whether every rank's skeleton hash is rank 0's (a rank without one: no)."""
    first = values[0].get("tree_hash")
    return first is not None and all(v.get("tree_hash") == first for v in values)


class PlanExchange:
    """The plan exchange of one engine (training thread only; see the module docstring).

    A save: every rank's :meth:`value` goes to rank 0 only (``Group.decide``), whose
    :meth:`decide` answers every rank with one small verdict; :meth:`apply` turns it into the
    plan, or None when the chunk lists must go to rank 0 (:meth:`full_value`), whose
    :meth:`assign` plans every rank and answers each with its part (:meth:`take`). The verdict
    is "reuse" only when every rank's value names the same previous exchange (``base``: a rank
    that missed one, its wait timed out where others' did not, has another), every layout hash
    is the one that rank sent then, and no replicated tensor that several ranks hold now
    differs between them (it would be written once for ranks whose copies differ). A tensor
    that was per rank stays per rank until the next full exchange even if its copies became
    equal (each rank still writes and loads its own: correct at the same world size, only not
    reshardable).
    """

    def __init__(self, rank_indexes: int | None = None) -> None:
        #: (rank 0) the world size from which plans are indexed (CheckpointOptions.rank_indexes)
        self.rank_indexes = rank_indexes
        self._last: _Reusable | None = None
        self._layout: tuple = ((), "", None)  # this rank's last layout, its hash, its table's
        self._made: tuple | None = None  # (rank 0) the plan assign made, until take
        self._specs: list = []  # this rank's specs at its last value (rank 0's decide)
        #: rank 0's table hash, list layout hash and fingerprints, and the ranks named to
        #: send a table or a list for others (hash -> rank), from the verdict
        self._ref: tuple = (None, None, None, {}, {})
        self._solo: list = []  # the rows of the chunks this rank alone holds (full_value)
        self._taken = ""  # this rank's layout hash at its last exchange (take)
        #: how the last plan was made: "reused", "exchanged" (the first) or "re-exchanged"
        self.how = ""

    # -- every rank ------------------------------------------------------------------------
    def value(self, save_id: str, specs: list, **extra) -> dict:
        last = self._last
        out = {"save_id": save_id, "base": last.base if last is not None else None,
               "hash": self._hash(specs), **extra}
        self._specs = specs
        if last is None or out["hash"] != self._taken:
            # (a full exchange is likely: the hashes of the table of solo boxes, of the list's
            # layout and of the list with its fingerprints, by which rank 0 names one rank
            # per distinct table and list layout to send it, :meth:`decide`: one per pipeline
            # stage, not per rank)
            _, rest, out["own_hash"], out["rest_hash"] = self._split(specs)
            out["list_hash"] = _list_hash(rest)
        if last is not None:
            regular = [s[7] for s in specs if not s[6]]
            if last.compact:
                # (an index past the list: the layout changed, the hash says so)
                watched = [regular[i] if i < len(regular) else None for i in last.mine]
                out["rep"] = _joint_hash(watched)
            else:
                out["digests"] = regular
        return out

    def _hash(self, specs: list) -> str:
        """This rank's layout hash, computed again only when the layout changed (comparing
        the tuples is C work; the hash is JSON + xxh3: ~10 ms for the 70B state's 2892)."""
        layout = tuple(tuple(s[:7]) + (solo_of(s),) for s in specs)
        if layout != self._layout[0]:
            self._layout = (layout, layout_hash(specs) if specs else "", None)
        return self._layout[1]

    def _split(self, specs: list) -> tuple[list, list, str, str]:
        """This rank's table of the chunks it alone holds (fqn, dtype, shape, mesh) and its
        list of the others (with their fingerprints), and the hash of the table and of the
        list's layout (without the fingerprints)."""
        self._hash(specs)
        table = [[s[0], s[1], s[2], s[8]] for s in specs if solo_of(s)]
        rest = [s[:8] for s in specs if not solo_of(s)]
        if self._layout[2] is None:  # (both change with the layout only)
            self._layout = (*self._layout[:2], (_joint_hash(table), layout_hash(rest)))
        return table, rest, *self._layout[2]

    def apply(self, verdict: dict, step: int) -> SavePlan | None:
        if verdict.get("error"):
            raise UnsupportedStateError(verdict["error"])
        if verdict["how"] != "reuse":
            self._ref = (verdict.get("own"), verdict.get("rest"), verdict.get("digests"),
                         verdict.get("tables") or {}, verdict.get("lists") or {})
            return None
        last = self._last
        assert last is not None  # the coordinator saw this rank's base
        plan = dataclasses.replace(last.plan, save_id=verdict["save_id"], step=step,
                                   format_version=verdict["format_version"],
                                   indexed=verdict.get("indexed", False),
                                   same_tree=verdict.get("same_tree", False))
        last.base = plan.save_id
        self.how = "reused"
        return plan

    def full_value(self, save_id: str, specs: list, *, rank: int = 0, **extra) -> dict:
        """The chunk lists for rank 0, with this rank's layout hash (the one :meth:`value`
        computed: rank 0 need not hash N lists again). Its solo chunks go as a table without
        their boxes, and the table and the list of the other chunks as ``None`` where their
        hash is rank 0's (the verdict carried those; a list with rank 0's layout sends the
        fingerprints that differ): under FSDP2 every rank's are rank 0's, and rank 0 plans N
        ranks from one list."""
        table, rest, own, rests = self._split(specs)
        self._solo = [s for s in specs if solo_of(s)]  # (which it writes: take decides)
        first, (ref_own, ref_rest, ref_digests, tables, lists) = rank == 0, self._ref
        out = {"save_id": save_id, "hash": self._hash(specs),
               "own": None if not first and own == ref_own else table,
               "own_bytes": sum(s[5] for s in specs if solo_of(s) and writes(s)),
               "specs": rest, **extra}
        named = lists.get(rests) if lists and not first else None
        if named is not None:
            sender, its_hash = named
            if sender != rank:  # another rank's list layout: that rank sends the list
                out["specs"], out["specs_as"] = None, sender
                if _list_hash(rest) != its_hash:  # (a per-rank RNG state): the fingerprints
                    out["digests_as"] = [s[7] for s in rest]
        elif not first and rests == ref_rest and len(rest) == len(ref_digests or ()):
            # rank 0's list but for some fingerprints (a per-rank RNG state): those alone
            out["specs"] = None
            out["differ"] = [[i, s[7]] for i, s in enumerate(rest) if s[7] != ref_digests[i]]
        if out["own"] is not None and not first and tables.get(own, rank) != rank:
            # another rank's table (the same pipeline stage): that rank sends it
            out["own"], out["own_as"] = None, tables[own]
        return out

    def take(self, answer: tuple, rank: int, step: int) -> SavePlan:
        """(every rank) This rank's plan from the coordinator's :meth:`assign` answer."""
        common, part = answer
        if rank == 0:
            plan, last = self._made  # (what assign computed for every rank)
            self._made = None
        else:
            plan = SavePlan(save_id=common["save_id"], step=step,
                            world_size=common["world_size"],
                            my_chunks=_chunk_specs(_merge(
                                part["chunks"], written(self._solo, common.get("alike", False)))),
                            tensors={}, format_version=common["format_version"],
                            indexed=common.get("indexed", False),
                            same_tree=common.get("same_tree", False))
            last = _Reusable(plan.save_id, plan, [], [], part.get("mine", common.get("mine")),
                             [], common["compact"])
        self.how = "re-exchanged" if self._last is not None else "exchanged"
        self._last, self._taken = last, self._layout[1]
        return plan

    # -- the coordinator ---------------------------------------------------------------------
    def decide(self, values: list[dict]) -> dict:
        """(rank 0) The verdict for every rank, from every rank's :meth:`value`."""
        # rank 0's uploader decides: it names every chained upload, so while it is busy a
        # deferred step is its chain's to name, and once it is idle no chain will name one
        # (the others' uploads of the step it waited for are over; a deferred step would
        # stay behind: remote_state "deferred" for good)
        out = {"up_busy": bool(values[0].get("up_busy")),
               "error": state_errors(values), "how": "exchange"}
        if out["error"] or not self._reuses(values):
            if not out["error"]:  # what each rank compares its table and its list with
                _, rest, out["own"], out["rest"] = self._split(self._specs)
                out["digests"] = [s[7] for s in rest]
                out["tables"] = _senders(values, "own_hash", out["own"])
                out["lists"] = {h: [r, values[r].get("list_hash")] for h, r in
                                _senders(values, "rest_hash", out["rest"]).items()}
            return out
        per_rank = any(m.get("per_rank") for m in self._last.plan.tensors.values())
        v2 = per_rank or any(v.get("aliases") for v in values)
        return {**out, "how": "reuse", "save_id": values[0]["save_id"],
                "format_version": 2 if v2 else 1, "indexed": self._indexed(len(values)),
                "same_tree": _same_tree(values)}

    def _reuses(self, values: list[dict]) -> bool:
        """(rank 0) Whether the last exchange's plan holds for every rank's value."""
        last = self._last
        if (last is None or any(v["base"] != last.base for v in values)
                or [v["hash"] for v in values] != last.hashes):
            return False
        if last.compact:
            seen: dict = {}
            for r, v in enumerate(values):
                g = last.group[r]
                if g is not None and seen.setdefault(g, v["rep"]) != v["rep"]:
                    return False  # a shared replicated tensor differs now between its holders
            return True
        keys: dict = {}
        for r, v in enumerate(values):
            d = v["digests"]
            for key, i in zip(last.watch[r][1], last.watch[r][0]):
                if keys.setdefault(key, d[i]) != d[i]:
                    return False
        return True

    def _indexed(self, world: int) -> bool:
        return self.rank_indexes is not None and world >= self.rank_indexes

    def assign(self, values: list[dict], step: int) -> tuple[dict, list[dict]]:
        """(rank 0) The plan of every rank from every rank's :meth:`full_value`: one part for
        all (the save id, the format, the fingerprint mode) and one per rank (the chunks it
        writes, the places of the fingerprints it must hash for the next verdict). Each rank
        receives only its own part (``Group.decide(..., each=True)``): O(N) bytes through the
        store where every rank parsing every list moved O(N^2)."""
        rows, plan = make_plans(values, step)
        plan = dataclasses.replace(plan, indexed=self._indexed(len(values)),
                                   same_tree=_same_tree(values),
                                   my_chunks=_chunk_specs(_merge(rows[0], written(
                                       self._solo, _alike(values)))))
        last = self._reusable(values, plan)
        self._made = (plan, last)
        common = {"save_id": plan.save_id, "format_version": plan.format_version,
                  "world_size": plan.world_size, "compact": last.compact,
                  "indexed": plan.indexed, "same_tree": plan.same_tree,
                  "mine": last.watch[0][0], "alike": _alike(values)}
        # (a rank whose list is rank 0's watches the same places: the common part has them)
        return common, [{"chunks": rows[r]} if last.watch[r] is last.watch[0] else
                        {"chunks": rows[r], "mine": last.watch[r][0]}
                        for r in range(len(values))]

    @staticmethod
    def _reusable(gathered: list[dict], plan: SavePlan) -> _Reusable:
        """(rank 0) What the verdicts after this exchange compare, for every rank."""
        # the replicated tensors (not per rank) held by more than one rank, by their place in
        # each holder's regular-tensor fingerprints (DTensor boxes have none: never per rank)
        # A rank whose list is rank 0's (None) or another's (specs_as) watches what that one does
        per_rank = {fqn for fqn, m in plan.tensors.items() if m.get("per_rank")}
        n = len(gathered)
        lead = _leads(gathered)
        size: dict = {}
        for a in lead:
            size[a] = size.get(a, 0) + 1
        places: dict = {}  # the ranks that sent a list: key -> place
        holders: dict = {}  # key -> those ranks holding it, rank 0 aside
        count: dict = {}
        for a in size:
            regular = [s for s in gathered[a]["specs"] if not s[6]]
            places[a] = {(s[0], tuple(s[3])): j for j, s in enumerate(regular)}
            for key in places[a]:
                if key[0] not in per_rank:
                    count[key] = count.get(key, 0) + size[a]
                    if a:
                        holders.setdefault(key, []).append(a)
        shared = sorted(k for k, c in count.items() if c > 1)
        watched: dict = {a: [] for a in places}
        for key in shared:
            for a in ([0] if key in places[0] else []) + holders.get(key, []):
                watched[a].append(key)
        sig: dict = {}
        gid = {a: sig.setdefault(tuple(w), len(sig)) if w else None for a, w in watched.items()}
        compact = all(len({gid[a] for a in ([0] if key in places[0] else [])
                           + holders.get(key, [])}) == 1 for key in shared)
        mine = {a: ([places[a][k] for k in w], w) for a, w in watched.items()}
        watch = [mine[lead[r]] for r in range(n)]
        group = [gid[lead[r]] for r in range(n)]
        hashes = [g["hash"] if isinstance(g.get("hash"), str) else
                  layout_hash(g["specs"]) if g["specs"] else "" for g in gathered]
        return _Reusable(plan.save_id, plan, hashes, watch, watch[0][0], group, compact)
