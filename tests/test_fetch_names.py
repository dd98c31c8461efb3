"""Issue 29: names two models share are resolved by id. A member may name its model anything: the
name of another model, or another model's id. `join --model-id NAME` of a shared name is one error
listing every id in full (the ids it listed were cut to 16 digits, which match nothing), and an id
names its model whatever any other is named.

In-process daemons on loopback: a seed, attackers (tests/attackers.py) whose records say they hold
models of their making, and a volunteer joining by model id or name with no file.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path

import trio
from attackers import attacker, every_layer, fake_model, running

from meshd.client.ask import first_error
from meshd.daemon import MeshDaemon
from meshd.daemon.config import NodeConfig
from meshd.mesh.models import ModelNotFound
from meshd.stage.model_file import describe_model
from meshd.store.manifest import compute
from wire.identity import NodeIdentity

NAME = "shared-name"


def seed_node() -> AbstractAsyncContextManager[MeshDaemon]:
    return running(MeshDaemon(NodeIdentity.generate(), NodeConfig()))


async def join_by(seed: MeshDaemon, wanted: str, state_dir: Path) -> BaseException:
    """What a volunteer joining with `--model-id wanted` and no file ends with."""
    joiner = MeshDaemon(NodeIdentity.generate(), NodeConfig(seeds=(seed.address,), model_id=wanted, model_wait=3.0,
                                                            state_dir=state_dir))
    try:
        await joiner.run()
    except BaseExceptionGroup as group:
        return first_error(group)
    except Exception as exc:
        return exc
    raise AssertionError("the join did not end")


async def test_a_name_two_models_share_is_one_error_listing_both_ids_and_an_id_resolves_its_model(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = tiny_models["llama-gqa-untied"]
    real = describe_model(path, compute(path, 4 << 10).model_id)
    first = fake_model(real).model_copy(update={"name": NAME, "digest": "a" * 64})
    second = fake_model(real).model_copy(update={"name": NAME, "digest": "b" * 64})
    # a third member names its model with the first one's id
    squatter = fake_model(real).model_copy(update={"name": first.digest, "digest": "c" * 64})
    # a bound on waiting for four daemons, their gossip and two joins (seconds on a quiet box), not a speed claim
    with trio.fail_after(60):
        async with seed_node() as seed, attacker(seed.address) as a, attacker(seed.address) as b, \
                attacker(seed.address) as c:
            for member, model in ((a, first), (b, second), (c, squatter)):
                member.forge(models=[model], served=every_layer(model))
            while {m.digest for r in seed.live_records() for m in r.models} != {"a" * 64, "b" * 64, "c" * 64}:
                await trio.sleep(0.1)
            ambiguous = await join_by(seed, NAME, tmp_path / "by-name")
            # by id: the first model, not refused as ambiguous with the squatter's; its holder then
            # sends no manifest (it has no file), which is where this join ends
            by_id = await join_by(seed, first.digest.upper(), tmp_path / "by-id")
    assert isinstance(ambiguous, ModelNotFound), repr(ambiguous)
    assert f"'{NAME}' names 2 models of the mesh: {'a' * 64}, {'b' * 64}" in str(ambiguous)
    assert isinstance(by_id, ModelNotFound), repr(by_id)
    assert f"no member sent the manifest of model {first.digest[:16]}" in str(by_id)

