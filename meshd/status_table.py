"""`meshd status` for people (a table within 80 columns) and for scripts (JSON with stable keys).

Everything shown comes from peers: node ids, addresses, model names, reasons.
Control and formatting characters are replaced before anything reaches a
terminal (no escape sequence from a peer is ever printed), and every line is
measured in terminal columns (wide characters count two), so no name or reason,
however long or strange, makes a line wider than asked.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from wire.meshrpc import LinkStatus, MemberStatus, ModelCoverage, StageSpeed, StatusReply

WIDTH = 80
NODE = 16
ADDRESS = 21  # 255.255.255.255:65535; a longer address (IPv6, a DNS name) goes on a line of its own
STATE = 7  # suspect
MEMORY = 8  # 1023 MiB
GAP = "  "
DETAIL = " " * (NODE + len(GAP))
RANGE = 12  # [4095, 4096)
MS = 9  # ms/layer: 3 significant digits, up to 3.6e+06
PATH = 8  # relayed


def clean(text: str) -> str:
    """`text` with every control, format, separator-other or unassigned character shown as '?'."""
    if text.isascii() and text.isprintable():
        return text
    return "".join("?" if unicodedata.category(ch)[0] == "C" or ch in "\u2028\u2029" else ch for ch in text)


def columns(text: str) -> int:
    """How many terminal columns `text` (already cleaned) takes."""
    if text.isascii():
        return len(text)
    return sum(char_columns(ch) for ch in text)


def char_columns(ch: str) -> int:
    if unicodedata.combining(ch):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def wrap(text: str, width: int = WIDTH, first: str = "", rest: str = "") -> list[str]:
    """`text` word-wrapped by columns: `first` leads the first line, `rest` the others."""
    return fill(clean(text).split(), width, first, rest)


def wrap_items(items: list[str], sep: str, width: int = WIDTH, first: str = "", rest: str = "") -> list[str]:
    """`items` joined by `sep` (such as "; "), each kept whole on one line where it fits one."""
    words = [clean(item).strip() + sep.rstrip() for item in items[:-1]] + [clean(item).strip() for item in items[-1:]]
    return fill(words, width, first, rest)


def fill(words: list[str], width: int, first: str, rest: str) -> list[str]:
    """Greedy fill by columns, one space between words; a word wider than a line is cut where the line ends."""
    lines: list[str] = []
    line, used = first, columns(first)
    fresh = True  # nothing but the indent on this line yet
    for word in words:
        if not fresh and used + 1 + columns(word) > width:
            lines.append(line)
            line, used, fresh = rest, columns(rest), True
        if not fresh:
            line, used = line + " ", used + 1
        fresh = False
        if word.isascii() and used + len(word) <= width:
            line, used = line + word, used + len(word)
            continue
        for ch in word:
            w = char_columns(ch)
            if used + w > width:
                lines.append(line)
                line, used = rest, columns(rest)
            line, used = line + ch, used + w
    lines.append(line)
    return lines


def pad(text: str, width: int, right: bool = False) -> str:
    """`text` (cleaned, at most `width` columns) padded with spaces to `width` columns."""
    space = " " * max(0, width - columns(text))
    return space + text if right else text + space


def plural(n: int, word: str) -> str:
    return f"{n} {word if n == 1 else word + 's'}"


def size(n: int) -> str:
    """Bytes in at most MEMORY columns: up to 9999 of the smallest unit from MiB up that holds them."""
    for shift, unit in ((20, "MiB"), (30, "GiB"), (40, "TiB"), (50, "PiB")):
        if n < 9999.5 * (1 << shift):
            return f"{n / (1 << shift):.0f} {unit}"
    return f"{n / (1 << 60):.0f} EiB"


def short(text: str, width: int) -> str:
    """`text` cleaned and cut to `width` columns (ids and labels: their start names them)."""
    out, used = "", 0
    for ch in clean(text):
        used += char_columns(ch)
        if used > width:
            break
        out += ch
    return out


def render(s: StatusReply, width: int = WIDTH) -> str:
    """The status reply as lines of at most `width` columns (80 unless asked otherwise)."""
    head = f"tracker: {short(s.tracker, NODE) if s.tracker else 'none elected'} (term {s.term}); " \
           f"{plural(len(s.members), 'member')}; asked node {short(s.node_id, NODE)}"
    lines = wrap(head, width)
    lines.append("")
    if s.members:
        lines.append(f"{'NODE':<{NODE}}{GAP}{'ADDRESS':<{ADDRESS}}{GAP}{'STATE':<{STATE}}{GAP}"
                     f"{'MEMORY':>{MEMORY}}{GAP}ROLES")
        for m in sorted(s.members, key=lambda m: m.node_id):
            lines.extend(member_lines(m, width))
    else:
        lines.append("no members known")
    lines.append("")
    if not s.coverage:
        lines.append("no live member holds a model")
    for c in s.coverage:
        lines.extend(coverage_lines(c, width))
        lines.extend(speed_lines(s, c.model, width))
    if s.links:
        lines.append("")
        lines.append(f"links of node {short(s.node_id, NODE)}:")
        lines.append(f"  {'NODE':<{NODE}}{GAP}{'PATH':<{PATH}}{GAP}{'RTT MS':>{MS}}{GAP}ADDRESS")
        for link in s.links:
            lines.extend(link_lines(link, width))
    if s.relayed_bytes is not None:
        lines.append(f"relayed through this node: {s.relayed_bytes} bytes")
    return "\n".join(lines)


def link_lines(link: LinkStatus, width: int) -> list[str]:
    """One link: to whom, direct, punched (through two NATs) or relayed, its round trip and address."""
    rtt = "-" if link.rtt_ms is None else f"{link.rtt_ms:.3g}"
    row = f"  {pad(short(link.node_id, NODE), NODE)}{GAP}{pad(short(link.path, PATH), PATH)}{GAP}" \
          f"{pad(rtt, MS, right=True)}{GAP}"
    return wrap(clean(link.address) or "-", width, row, " " * columns(row))


def member_lines(m: MemberStatus, width: int) -> list[str]:
    address = clean(m.address) or "-"
    roles = clean(",".join(m.roles)) or "-"
    memory = size(m.memory_bytes) if m.memory_bytes else "-"
    fits_address = columns(address) <= ADDRESS
    row = pad(short(m.node_id, NODE), NODE) + GAP + pad(address if fits_address else "(below)", ADDRESS) + GAP + \
        pad(short(m.state, STATE), STATE) + GAP + pad(memory, MEMORY, right=True) + GAP
    fits_roles = columns(row) + columns(roles) <= width
    lines = [row + (roles if fits_roles else "(below)")]
    if not fits_address:
        lines.extend(wrap(address, width, DETAIL + "address: ", DETAIL + "  "))
    if not fits_roles:
        lines.extend(wrap_items(list(m.roles), ", ", width, DETAIL + "roles: ", DETAIL + "  "))
    if m.served:
        lines.extend(wrap_items(list(m.served), "; ", width, DETAIL + "serves: ", DETAIL + "  "))
    if m.offload:
        lines.extend(wrap(clean(m.offload), width, DETAIL + "GPU: ", DETAIL + "  "))
    if m.reachability == "nat":
        lines.append(DETAIL + "behind NAT, reachable via:" + ("" if m.relay_addresses else " no relay yet"))
        for relay in m.relay_addresses:
            lines.extend(wrap(relay, width, DETAIL + "  ", DETAIL + "  "))
    return lines


def coverage_lines(c: ModelCoverage, width: int) -> list[str]:
    # the figures stay whole on one line, however the name wraps: scripts and people look for "30/30 layers covered"
    # its file's name too: the GGUF's own name is often not the one its user knows it by
    known = f"{clean(c.file)}.gguf, " if c.file and c.file != c.name else ""
    words = ["model", *clean(c.name).split(), f"({known}{short(c.model, 12)}):",
             f"{c.covered_layers}/{plural(c.n_layers, 'layer')} covered, {plural(c.replicas, 'spare replica')};"]
    lines = fill(words, width, "", "  ")
    lines.extend(wrap_items(list(c.assigned) or ["none yet"], "; ", width, "  stages: ", "    "))
    if c.reason:
        lines.extend(wrap(c.reason, width, "  not covered: ", "    "))
    if c.unverified:
        lines.extend(wrap_items(list(c.unverified), "; ", width, "  unverified (no replica to check on): ", "    "))
    return lines


def ms(seconds: float) -> str:
    return f"{seconds * 1000.0:.3g}"


def speed_from(speed: StageSpeed, by: str | None, tracker: str | None) -> str:
    """Where the figure routes count for a stage came from, as people read it (`by`: whose figures)."""
    who = "tracker" if by is not None and by == tracker else f"node {short(by or '?', 12)}"
    said = f"; it says {ms(speed.declared)}" if speed.declared and speed.source != "declared" else ""
    if speed.source == "probe":
        return f"probe by {who}, median of {speed.samples}{said}"
    if speed.source == "own":
        return f"the {who}'s own stage{said}"
    if speed.source == "default":
        return f"unmeasured: default{said}"
    if speed.source == "traffic":
        # what real asks saw: a figure of one reporter is the tracker's own asks' (others need a quorum)
        whose = "the tracker's own asks" if speed.samples == 1 else f"median of {speed.samples} askers"
        return f"traffic seen by askers, {whose}{said}"
    if speed.source == "declared":
        return "self-declared (unmeasured)"  # slower than the default: its word counts against it alone
    return clean(speed.source)  # a source a newer node names


def speed_lines(s: StatusReply, model: str, width: int) -> list[str]:
    """Each served range of `model` with the ms per layer routes count for it, and where that came from."""
    speeds = sorted((p for p in s.speeds if p.model == model), key=lambda p: (p.start, p.end, p.node_id))
    if not speeds:
        return []
    lines = [f"  {'RANGE':<{RANGE}}{GAP}{'NODE':<{NODE}}{GAP}{'MS/LAYER':>{MS}}{GAP}FROM"]
    for p in speeds:
        row = f"  {pad(f'[{p.start}, {p.end})', RANGE)}{GAP}{pad(short(p.node_id, NODE), NODE)}{GAP}" \
              f"{pad(ms(p.seconds_per_layer), MS, right=True)}{GAP}"
        lines.extend(wrap(speed_from(p, s.speeds_by, s.tracker), width, row, " " * columns(row)))
    return lines


def as_json(s: StatusReply) -> dict[str, Any]:
    """The keys `meshd status --json` prints (README, "meshd status --json"): named here, one by
    one, so a change to the wire's schema cannot change them unnoticed."""
    return {
        "node_id": s.node_id,
        "tracker": s.tracker,
        "term": s.term,
        "members": [{
            "node_id": m.node_id, "address": m.address or None, "state": m.state, "roles": list(m.roles),
            "reachability": m.reachability, "memory_bytes": m.memory_bytes, "served": list(m.served),
            "models": list(m.models), "relay_addresses": list(m.relay_addresses), "offload": m.offload or None,
        } for m in sorted(s.members, key=lambda m: m.node_id)],
        "coverage": [{
            "model": c.model, "name": c.name, "n_layers": c.n_layers, "covered_layers": c.covered_layers,
            "covered": c.covered_layers == c.n_layers, "replicas": c.replicas, "assigned": list(c.assigned),
            "reason": c.reason or None, "unverified": list(c.unverified), "file": c.file or None,
        } for c in s.coverage],
        "fetches": [{
            "model": f.model, "name": f.name, "start": f.start, "end": f.end, "done_bytes": f.done_bytes,
            "total_bytes": f.total_bytes, "fetched_bytes": f.fetched_bytes, "rate": f.rate, "sources": f.sources,
            "state": f.state,
        } for f in s.fetches],
        "speeds_by": s.speeds_by,
        "speeds": [{
            "node_id": p.node_id, "model": p.model, "start": p.start, "end": p.end,
            "ms_per_layer": p.seconds_per_layer * 1000.0, "source": p.source, "samples": p.samples,
            "declared_ms_per_layer": p.declared * 1000.0 or None,
        } for p in s.speeds],
        "links": [{"node_id": link.node_id, "path": link.path, "address": link.address or None,
                   "rtt_ms": link.rtt_ms} for link in s.links],
        "relayed_bytes": s.relayed_bytes,
    }
