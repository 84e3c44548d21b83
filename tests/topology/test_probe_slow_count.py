"""The probe's output counts the slow parts once (issue 22): it printed "slow: 5" from its measurements
and "slow links: 6" from the graph's edges for the same run."""

from __future__ import annotations

from test_collective_probe import _measurements

from core.ranks import RankLayout
from flexshard.probe import probe_text
from topology.probe.results import measured_graph, slow_parts


def test_the_probe_counts_the_slow_parts_once():
    """A slow host (both its GPUs' NICs at a quarter speed): the report counts the slow parts by kind,
    and the graph's summary, whose slow links are the same parts seen on edges, does not count again."""
    hosts = ["h0"] * 2 + ["h1"] * 2 + ["h2"] * 2 + ["h3"] * 2
    m = _measurements(
        hosts, RankLayout.by_host(hosts).to_lists(), {"intra": 100.0, "inter": 20.0}, slow_ranks={0, 1}
    )
    text = probe_text(m, measured_graph(m, name="synthetic"), ["a note"])
    slow_lines = [ln for ln in text.splitlines() if ln.startswith("slow")]
    found = slow_parts(m)
    kinds = {w: sum(s["what"] == w for s in found) for w in ("pair", "rank", "host")}
    assert kinds == {"pair": 12, "rank": 2, "host": 1}  # ranks 0, 1 to the 6 others; ranks 0, 1; h0
    assert slow_lines == ["slow: 15 below 0.5 x the median of their class (12 pairs, 2 ranks, 1 host)"]
    assert text.splitlines()[0] == "a note"
