"""A slow host on the fabric (experiments/skewed_fabric.py): the skew-aware plan moves cold rows and
inter-group traffic off the slow host and beats the skew-blind plan on the skewed view."""

from __future__ import annotations

import pytest
from experiment_module import load_experiment


@pytest.fixture(scope="module")
def result():
    module = load_experiment("skewed_fabric")
    return module, module.compare(8, 2.0)


def test_skew_aware_plan_unloads_the_slow_host_and_is_faster(result):
    _, res = result
    aware, blind = res["records"]
    assert (aware["plan"], blind["plan"]) == ("skew-aware", "skew-blind")
    assert res["slow_inter_GBps"] == pytest.approx(12.5) and res["other_inter_GBps"] == pytest.approx(25.0)
    # the slow host holds a smaller cold share than the others, and than it does in the blind plan
    assert aware["slow_host_cold_share"] < aware["other_host_cold_share"]
    assert aware["slow_host_cold_share"] < blind["slow_host_cold_share"] == pytest.approx(1 / 8)
    # its ranks move fewer inter-group bytes than the others, and than in the blind plan
    assert aware["slow_inter_bytes"] < aware["other_inter_bytes"]
    assert aware["slow_inter_bytes"] < blind["slow_inter_bytes"]
    # modeled on the skewed view, the skew-aware plan is faster than the skew-blind one
    assert aware["modeled_time_s"] < blind["modeled_time_s"]
    assert blind["bottleneck_host"] == "node0"
    assert sum(aware["host_cold_shares"].values()) == pytest.approx(1.0)


def test_markdown_table_shows_the_records(result):
    """Each row of the table reads back to its record's figures, in the header's column order."""
    module, res = result
    lines = module.markdown(res).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[0] == "plan" and header[5].startswith("modeled bottleneck time")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert len(rows) == len(res["records"]) == 2
    for cells, r in zip(rows, res["records"], strict=True):
        assert cells[0] == r["plan"]
        assert float(cells[1].rstrip("%")) == pytest.approx(100 * r["slow_host_cold_share"], abs=0.005)
        assert float(cells[3]) == pytest.approx(r["slow_inter_bytes"] / 1e6, abs=0.05)
        assert float(cells[5]) == pytest.approx(r["modeled_time_s"] * 1e3, abs=5e-4)
        assert cells[6] == f"rank {r['bottleneck_rank']} ({r['bottleneck_host']})"
