"""Saving a matplotlib figure as a PNG that says what it shows: a caption and its axis labels.

    plot = save_figure(fig, path, "Bars above the dashed line are faster than vanilla.")
    plot.path, plot.caption, plot.labels        # labels: (x label, y label) of every axes

The report puts the caption under the image (``<figure><figcaption>``); a PNG that stands alone
(a training job's plot in its artefact directory) carries it drawn below the axes
(:func:`save_standalone`). The labels are read from the figure's axes as saved, so a test can
check that every axis names what it measures and its unit.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

#: characters per caption line drawn under a standalone figure, per inch of figure width
_CHARS_PER_INCH = 15
#: resolution of every written figure
DPI = 110


@dataclass(frozen=True)
class Plot:
    """A written PNG, its caption (what to see in it), its axes' ``(x label, y label)`` pairs (a
    twin axis has an empty x label: it shares the x axis) and its width ÷ height."""

    path: Path
    caption: str
    labels: tuple[tuple[str, str], ...]
    aspect: float


def axis_labels(fig) -> tuple[tuple[str, str], ...]:
    """``(x label, y label)`` of each axes of ``fig``, colour bars and twin axes included."""
    return tuple((ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes)


def save_figure(fig, path: Path, caption: str) -> Plot:
    """Lay out, write and close ``fig``; the caption travels with the returned :class:`Plot`."""
    return _write(fig, path, caption, (0, 0, 1, 1))


def save_standalone(fig, path: Path, caption: str) -> Plot:
    """:func:`save_figure` with the caption drawn under the axes, for a PNG read on its own."""
    width, height = fig.get_size_inches()
    lines = textwrap.wrap(caption, max(40, int(width * _CHARS_PER_INCH)))
    fig.text(0.01, 0.02, "\n".join(lines), fontsize=8, va="bottom", ha="left", color="#333")
    band = (0.15 * len(lines) + 0.1) / height  # the caption's share of the figure height
    return _write(fig, path, caption, (0, band, 1, 1))


def _write(fig, path: Path, caption: str, rect: tuple[float, float, float, float]) -> Plot:
    """Lay out and write ``fig``. The canvas is cut to what is drawn (``bbox_inches="tight"``), so a
    legend placed beside the axes, a long title or an axis label is kept whole, never clipped at
    the figure's edge; the aspect is the written image's."""
    import matplotlib.image
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    labels = axis_labels(fig)
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=DPI, bbox_inches="tight", pad_inches=0.05)
    plt.close(fig)
    rows, cols = matplotlib.image.imread(path).shape[:2]
    return Plot(path, caption, labels, float(cols / rows))


def legend_columns(entries: int, per_column: int = 12) -> int:
    """Columns for a legend of ``entries`` so that it stays about as tall as a 3.6-inch axes."""
    return max(1, -(-entries // per_column))
