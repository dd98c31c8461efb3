"""The small parts SWIM membership runs on (meshd.mesh.membership): its messages built from its own
state, token buckets by key, the queue of updates that ride on outgoing messages, and a set sampled
uniformly. The messages themselves live in wire.swim, with the record they carry."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, TypeVar

from wire.message import WireModel
from wire.swim import SWIM_MESSAGES, Alive, Dead, Suspect, SyncEntry, Update

_Made = TypeVar("_Made", bound=WireModel)
_DEFAULTS: dict[type[WireModel], dict[str, Any]] = {
    model: {name: field.default for name, field in model.model_fields.items() if not field.is_required()}
    for model in (Alive, Suspect, Dead, SyncEntry, *SWIM_MESSAGES)
}


def made(model: type[_Made], **fields: object) -> _Made:
    """A message or update built from this node's own state, not validated again (the receiver
    validates): a gossip round builds many, and validating them was most of its cost."""
    return model.unvalidated({**_DEFAULTS[model], **fields})


class Buckets:
    """Token buckets by key: a burst of `size`, refilled at `rate` a second. At most `cap` keys are
    kept: the one charged longest ago is forgotten first (its bucket would mostly be full again)."""

    def __init__(self, size: int, rate: float, cap: int) -> None:
        self._size, self._rate, self._cap = float(size), rate, cap
        self._buckets: dict[Any, tuple[float, float]] = {}  # key: (tokens, when counted), oldest first

    def take(self, key: Any, now: float) -> bool:
        """Whether `key` may spend a token now (then it has)."""
        tokens, at = self._buckets.pop(key, (self._size, now))
        tokens = min(self._size, tokens + (now - at) * self._rate)
        taken = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if taken else tokens, now)
        if len(self._buckets) > self._cap:
            del self._buckets[next(iter(self._buckets))]
        return taken


class BroadcastQueue:
    """Updates waiting to ride on outgoing messages: one per node (the newest), least-sent first."""

    def __init__(self) -> None:
        self._buckets: list[dict[str, Update]] = []  # index: times sent so far
        self._sent: dict[str, int] = {}

    def put(self, node_id: str, update: Update) -> None:
        sent = self._sent.get(node_id)
        if sent is not None:
            del self._buckets[sent][node_id]
        if not self._buckets:
            self._buckets.append({})
        self._buckets[0][node_id] = update
        self._sent[node_id] = 0

    def take(self, most: int, limit: int) -> list[Update]:
        """Up to `most` (at least one) updates, least sent first; each counts one more send, and one
        sent `limit` times is done. Moved bucket by bucket: a message's piggyback takes dozens."""
        buckets, sent_counts = self._buckets, self._sent
        groups: list[tuple[int, list[tuple[str, Update]]]] = []
        count = 0
        for sent, bucket in enumerate(buckets):
            if not bucket:
                continue
            if sent >= limit:
                # The cluster shrank and lowered the limit: these have been sent enough.
                for node_id in bucket:
                    del sent_counts[node_id]
                bucket.clear()
                continue
            group = list(islice(bucket.items(), most - count))
            groups.append((sent, group))
            count += len(group)
            if count >= most:
                break
        taken: list[Update] = []
        for sent, group in groups:
            bucket = buckets[sent]
            if len(group) == len(bucket):
                bucket.clear()
            else:
                for node_id, _ in group:
                    del bucket[node_id]
            sent += 1
            if sent >= limit:
                for node_id, _ in group:
                    del sent_counts[node_id]
            else:
                if sent == len(buckets):
                    buckets.append({})
                buckets[sent].update(group)
                sent_counts.update((node_id, sent) for node_id, _ in group)
            taken.extend(update for _, update in group)
        return taken

    def __len__(self) -> int:
        return len(self._sent)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._sent


class RandomSet:
    """A set with O(1) add, remove and uniform sampling, iterated in a reproducible order."""

    def __init__(self) -> None:
        self._items: list[str] = []
        self._index: dict[str, int] = {}

    def add(self, item: str) -> None:
        if item not in self._index:
            self._index[item] = len(self._items)
            self._items.append(item)

    def discard(self, item: str) -> None:
        index = self._index.pop(item, None)
        if index is None:
            return
        last = self._items.pop()
        if index < len(self._items):
            self._items[index] = last
            self._index[last] = index

    def sample(self, rng: random.Random, k: int, exclude: Iterable[str] = ()) -> list[str]:
        excluded = set(exclude)
        wanted = min(k, len(self._items) - sum(1 for item in excluded if item in self._index))
        if wanted <= 0:
            return []
        if wanted * 3 >= len(self._items):
            return rng.sample([item for item in self._items if item not in excluded], wanted)
        picked: list[str] = []
        while len(picked) < wanted:
            item = self._items[rng.randrange(len(self._items))]
            if item not in excluded:
                picked.append(item)
                excluded.add(item)
        return picked

    def __getitem__(self, index: int) -> str:
        return self._items[index]

    def __contains__(self, item: object) -> bool:
        return item in self._index

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)
