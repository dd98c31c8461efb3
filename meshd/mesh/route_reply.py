"""A route query's answer from one node's view: which model the asker means, the cheapest route of
assigned, served ranges over it (meshd.mesh.routing) and the replicas of each of its stages, named with
it so that the asker's spot checks cost no round trip before its first token."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from meshd.mesh.records import CapabilityRecord, ModelInfo
from meshd.mesh.routing import NoRouteError, Route, RouteKey, StageOption, plan_route
from wire.errors import ErrorCode, ProtocolError
from wire.meshrpc import MAX_REPLICAS_PER_STAGE, RouteReply, RouteStage


def pick_model(models: dict[str, ModelInfo], wanted: str | None) -> ModelInfo:
    """The model an asker means: by digest, or by name (its own or its file's) if one digest alone bears it; with none
    named, the mesh's only model. Never the first one heard of: any member can add a model (a
    made-up digest under a real model's name), so an ambiguous ask fails listing the candidates."""
    if wanted is not None:
        if wanted in models:
            return models[wanted]
        named = [info for info in models.values() if info.known_as(wanted)]
        if len(named) == 1:
            return named[0]
        if not named:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no member holds model {wanted[:64]}; "
                                f"the mesh holds: {_listed(models.values())}")
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(named)} models are named {wanted[:64]}: "
                            f"{_listed(named)}; name one by its digest")
    if not models:
        raise ProtocolError(ErrorCode.NOT_FOUND, "no member holds a model")
    if len(models) > 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"the mesh holds {len(models)} models: "
                            f"{_listed(models.values())}; name one with --model")
    return next(iter(models.values()))


def _listed(models: Iterable[ModelInfo], most: int = 8) -> str:
    shown = list(models)
    text = ", ".join(f"{info.name[:40]} ({info.digest})" for info in shown[:most])
    return text + (f" and {len(shown) - most} more" if len(shown) > most else "")


def replicas_of(route: Sequence[StageOption], options: Sequence[StageOption], exclude: Collection[str],
              records: Mapping[str, CapabilityRecord],
              address_of: Callable[[CapabilityRecord], str | None]) -> list[RouteStage]:
    """For each stage of ``route``, the fastest other members offered on exactly its range (up to
    MAX_REPLICAS_PER_STAGE): where the asker's spot checks run, named with the route so that
    finding them costs the asker no round trip before its first token."""
    on_route = {s.node_id for s in route}
    out: list[RouteStage] = []

    def numerics(node_id: str) -> str:
        record = records.get(node_id)
        return record.numerics if record is not None else ""

    for stage in route:
        # replicas of the stage's own numerics first: they compare bytes. Then those of other numerics
        # (another build or backend), named as such: the asker compares their sketches within a measured
        # tolerance (wire.sketch)
        mine = numerics(stage.node_id)

        def other(o: StageOption, mine: str = mine) -> bool:
            return bool(mine) and numerics(o.node_id) not in ("", mine)

        same = sorted((o for o in options if (o.start, o.end) == (stage.start, stage.end)
                       and o.node_id not in on_route and o.node_id not in exclude),
                      key=lambda o: (other(o), o.compute_seconds, o.node_id))
        taken = 0
        for o in same:
            address = address_of(records[o.node_id]) if o.node_id in records else None
            if address is not None:
                out.append(RouteStage(node_id=o.node_id, address=address, start=o.start, end=o.end,
                                      numerics=numerics(o.node_id) if other(o) else ""))
                taken += 1
                if taken == MAX_REPLICAS_PER_STAGE:
                    break
    return out


def same_numerics(options: Sequence[StageOption], routed_around: Iterable[CapabilityRecord],
                  records: Mapping[str, CapabilityRecord], model: str) -> list[StageOption] | None:
    """The options a failover's route tries first: on the layers each routed-around member served, only
    members of its numerics (a replica of other numerics computes other last bits, and the answer so far
    is its numerics'); None where no routed-around member said its numerics."""
    held: list[tuple[int, int, str]] = [(s.start, s.end, r.numerics) for r in routed_around if r.numerics
                                        for s in r.served if s.model == model]
    if not held:
        return None

    def fits(o: StageOption) -> bool:
        record = records.get(o.node_id)
        theirs = record.numerics if record is not None else ""
        return all(theirs == numerics for start, end, numerics in held if o.start < end and start < o.end)

    return [o for o in options if fits(o)]


def route_reply(info: ModelInfo, records: Mapping[str, CapabilityRecord], tries: Sequence[Sequence[StageOption]],
                link_cost: Callable[[str | None, str], float], exclude: Collection[str], keep: RouteKey | None,
                address_of: Callable[[CapabilityRecord], str | None],
                reason_of: Callable[[ModelInfo], str]) -> tuple[RouteReply, Route]:
    """The cheapest route for ``info`` over the stage options of the first of ``tries`` that covers it
    (the last is every option), keeping ``keep`` while it is nearly the cheapest, with the replicas
    of each stage among the last; ``records`` are the members the asker may be told of."""
    found, failure = None, None
    for offered in tries:
        try:
            found = plan_route(offered, info.n_layers, link_cost, exclude=exclude, keep=keep)
            break
        except NoRouteError as exc:
            failure = exc
    if found is None:
        reason = reason_of(info)
        raise ProtocolError(ErrorCode.NOT_FOUND, f"no route for {info.name}: {failure}"
                            + (f"; {reason}" if reason else ""))
    stages = []
    for s in found.stages:
        address = address_of(records[s.node_id])
        if address is None:
            raise ProtocolError(ErrorCode.UNREACHABLE, f"no address to dial {s.node_id[:12]}")
        stages.append(RouteStage(node_id=s.node_id, address=address, start=s.start, end=s.end))
    reply = RouteReply(model=info.digest, n_layers=info.n_layers, stages=stages, seconds_per_token=found.seconds,
                       replicas=replicas_of(found.stages, tries[-1], exclude, records, address_of))
    return reply, found
