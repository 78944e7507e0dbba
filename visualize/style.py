"""Colours: one palette for every renderer, so F is the same blue in a PNG, a terminal and a legend.

Op kinds get hues (after the Megatron / Zero Bubble figures: forward blue, backward green,
split backward teal and gold); a stage's chunk index on its rank lightens the hue, a replica
other than 0 is hatched (pictures) or underlined (terminal).
"""

from __future__ import annotations

from pipedsl.ir import Op

BASE = {
    Op.F: "#4e79a7",  # blue
    Op.B: "#59a14f",  # green
    Op.I: "#2a9d8f",  # teal
    Op.W: "#e9b949",  # gold
    Op.REDUCE_GRAD: "#b07aa1",  # purple
    Op.OPTIMIZER_STEP: "#9c755f",  # brown
    Op.SEND_F: "#2f4b6e",
    Op.SEND_B: "#356130",
    Op.RECV_F: "#c6d3e3",
    Op.RECV_B: "#cde2c9",
}
# The 16-colour terminal palette (rich names), used when the terminal has no 256 / true colour:
# (chunk 0, later chunks).  Downsampled hex colours would make F and B the same grey there.
ANSI = {
    Op.F: ("blue", "bright_blue"),
    Op.B: ("green", "bright_green"),
    Op.I: ("cyan", "bright_cyan"),
    Op.W: ("yellow", "bright_yellow"),
    Op.REDUCE_GRAD: ("magenta", "bright_magenta"),
    Op.OPTIMIZER_STEP: ("red", "bright_red"),
}
IDLE = "#f2f2f2"  # the empty band behind a rank's row
GRID = "#d9d9d9"
TEXT = "#222222"
REPLICA_HATCH = ("", "////", "\\\\\\\\", "xxxx")


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    h = hex_colour.lstrip("#")
    return tuple(int(h[i:i + 2], 16) / 255 for i in (0, 2, 4))  # type: ignore[return-value]


def _hex(rgb: tuple[float, float, float]) -> str:
    return "#" + "".join(f"{round(max(0.0, min(1.0, c)) * 255):02x}" for c in rgb)


def mix(colour: str, other: str, amount: float) -> str:
    """`colour` moved `amount` (0…1) of the way towards `other`."""
    a, b = _rgb(colour), _rgb(other)
    return _hex(tuple(x + (y - x) * amount for x, y in zip(a, b)))  # type: ignore[arg-type]


def fill(op: Op, chunk: int = 0, chunks: int = 1) -> str:
    """Face colour of a box: the op's hue, lighter for later chunks (chunk 0 is the full hue)."""
    base = BASE[op]
    if chunks <= 1 or chunk <= 0:
        return base
    return mix(base, "#ffffff", 0.55 * chunk / (chunks - 1))


def edge(face: str) -> str:
    return mix(face, "#000000", 0.35)


def luminance(colour: str) -> float:
    r, g, b = _rgb(colour)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_on(face: str) -> str:
    """Black or white, whichever reads better on `face`."""
    return "#1a1a1a" if luminance(face) > 0.56 else "#ffffff"


def ansi(op: Op, chunk: int = 0) -> str:
    """A rich style for a box in a 16-colour terminal: the op's colour, bright for later chunks."""
    colour = ANSI[op][1 if chunk > 0 else 0]
    text = "black" if colour.startswith("bright") or op in (Op.I, Op.W) else "white"
    return f"{text} on {colour}"


def hatch(replica: int) -> str:
    return REPLICA_HATCH[replica % len(REPLICA_HATCH)]
