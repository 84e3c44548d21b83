"""The collective half of the cluster probe: fitting, schedules, graphs from measurements, bounded joins.

The multi-process probe itself (real gloo ranks on loopback) is tested through the command line in
tests/flexshard/test_probe_cli.py.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time

import numpy as np
import pytest
from fake_nvml import fake_nvswitch_node

from core.errors import ConfigError
from core.osutil import free_port
from core.ranks import RankLayout, launcher_gpu, local_gpu, pick_backend
from core.vocabulary import LinkClass
from topology import TopologyError, cluster_view, read_json, slow_links, write_json
from topology.probe import (
    Fit,
    Measurements,
    ProbeConfig,
    ProbeError,
    RankInfo,
    fit_latency_bandwidth,
    measured_graph,
    median_measurements,
    merge_hosts,
    probe_host,
    probe_report,
    rank_links,
    rendezvous,
    restrict_to_job,
    sample_pairs,
    schedule_rounds,
    slow_parts,
)
from topology.probe.results import collective_latency
from topology.probe.session import usable_cpus
from topology.probe.timing import bus_factors, collectives_to_time
from topology.views import summary as topology_summary

GB = 1e9
SIZES = (8 * 1024, 256 * 1024, 2 * 1024 * 1024)


def _fit(bw_GBps: float, lat_us: float) -> Fit:
    return fit_latency_bandwidth(SIZES, [lat_us * 1e-6 + s / (bw_GBps * GB) for s in SIZES])


def _measurements(
    hosts: list[str], groups: list[list[int]], bw: dict[str, float], slow_ranks: set[int] = frozenset()
) -> Measurements:
    """Synthetic measurements: intra pairs at bw['intra'], inter pairs at the slower end's NIC speed."""
    infos = tuple(
        RankInfo(r, h, hosts[:r].count(h), "cpu", None, 8 * 2**30, "cpu") for r, h in enumerate(hosts)
    )
    group_of = {r: k for k, g in enumerate(groups) for r in g}
    pairs = {}
    for a in range(len(hosts)):
        for b in range(a + 1, len(hosts)):
            if group_of[a] == group_of[b]:
                pairs[(a, b)] = _fit(bw["intra"], 3.0)
            else:
                speed = bw["inter"] / (4 if {a, b} & slow_ranks else 1)
                pairs[(a, b)] = _fit(speed, 10.0)
    return Measurements(
        ranks=infos,
        groups=tuple(tuple(g) for g in groups),
        group_names=tuple(f"g{k}" for k in range(len(groups))),
        pairs=pairs,
        collectives={"all_to_all/world": _fit(5.0, 20.0)},
        bus_factor={"all_to_all/world": 0.75},
        config=ProbeConfig.quick(),
        seconds=1.0,
    )


# --- fitting ----------------------------------------------------------------------------------------


def test_fit_recovers_latency_and_bandwidth():
    fit = _fit(12.5, 7.0)
    assert fit.bandwidth_GBps == pytest.approx(12.5, rel=1e-6)
    assert fit.latency_us == pytest.approx(7.0, rel=1e-6)
    noisy = fit_latency_bandwidth(
        [1000, 1000, 1000, 10**6, 10**6, 10**6], [1e-5, 9e-3, 1e-5, 1e-3, 1e-3, 1e-3]
    )
    assert noisy.median_s == (1e-5, 1e-3)  # medians per size, the outlier ignored


def test_fit_flat_or_single_size_falls_back_to_throughput():
    flat = fit_latency_bandwidth([1000, 2000], [5e-6, 4e-6])  # negative slope: noise
    assert flat.bandwidth_GBps == pytest.approx(2000 / 4e-6 / GB)
    assert flat.latency_us == pytest.approx(4.0)
    single = fit_latency_bandwidth([10**6], [1e-3])
    assert single.bandwidth_GBps == pytest.approx(1.0) and single.latency_s == 0.0
    with pytest.raises(ProbeError, match="no samples"):
        fit_latency_bandwidth([], [])


def test_median_of_probes_is_the_per_size_median_fitted_again():
    hosts, groups = ["h"] * 4, [[0, 1], [2, 3]]
    probes = [_measurements(hosts, groups, {"intra": bw, "inter": bw / 2}) for bw in (4.0, 1.0, 2.0)]
    probes[1] = dataclasses.replace(
        probes[1], collectives={"all_to_all/world": _fit(9.0, 900.0)}, seconds=2.5
    )
    got = median_measurements(probes)
    # every size's median is the 2 GB/s probe's time (bandwidths 4, 1, 2: times t/4, t, t/2)
    assert got.pairs[(0, 1)].bandwidth_GBps == pytest.approx(2.0, rel=1e-9)
    assert got.pairs[(0, 2)].bandwidth_GBps == pytest.approx(1.0, rel=1e-9)
    assert got.pairs[(0, 1)].latency_us == pytest.approx(3.0, rel=1e-6)
    # the collective: two probes at 20 us, 5 GB/s and an outlier at 900 us: the median ignores it
    world = got.collectives["all_to_all/world"]
    assert world.latency_us == pytest.approx(20.0, rel=1e-6) and world.bandwidth_GBps == pytest.approx(5.0)
    assert got.seconds == pytest.approx(4.5) and got.groups == probes[0].groups
    assert median_measurements(probes[:1]) is probes[0]
    with pytest.raises(ProbeError, match="no probes"):
        median_measurements([])
    other = dataclasses.replace(probes[2], collectives={"all_reduce/replicas": _fit(5.0, 20.0)})
    with pytest.raises(ProbeError, match="different groups, pairs or collectives"):
        median_measurements([probes[0], other])


# --- groups and schedules ---------------------------------------------------------------------------


def test_collectives_follow_the_groups():
    """The process groups a step uses: all-to-all in the groups, across the job and between rail peers (the
    ranks at the same position of every group), all-reduce across the rail groups and the job; the bus
    factor of each."""
    three = RankLayout.consecutive(6, 3)
    timed = dict(collectives_to_time(three, ProbeConfig()))
    assert timed == {
        "all_to_all/group": [[0, 1], [2, 3], [4, 5]],
        "all_to_all/world": [[0, 1, 2, 3, 4, 5]],
        "all_to_all/rail": [[0, 2, 4], [1, 3, 5]],
        "all_reduce/replicas": [[0, 2, 4], [1, 3, 5]],
        "all_reduce/world": [[0, 1, 2, 3, 4, 5]],
    }
    assert bus_factors(list(timed.items())) == pytest.approx(
        {
            "all_to_all/group": 1 / 2,
            "all_to_all/world": 5 / 6,
            "all_to_all/rail": 2 / 3,
            "all_reduce/replicas": 4 / 3,
            "all_reduce/world": 10 / 6,
        }
    )
    assert [name for name, _ in collectives_to_time(RankLayout.single(3), ProbeConfig())] == [
        "all_to_all/group",
        "all_reduce/world",
    ]
    assert collectives_to_time(three, ProbeConfig(collectives=False)) == []


def test_collective_latencies_become_graph_attributes_at_their_participants():
    """The fitted latency of each collective lands in ``collective_latency_us`` at its group's size (a
    non-positive intercept gives way to the median time at the smallest size)."""
    m = dataclasses.replace(
        _measurements(["h0", "h0", "h1", "h1"], [[0, 1], [2, 3]], {"intra": 100.0, "inter": 10.0}),
        collectives={
            "all_to_all/group": _fit(20.0, 12.0),
            "all_to_all/world": _fit(10.0, 30.0),
            "all_reduce/replicas": Fit(-1e-6, 1e9, (4096, 65536), (40e-6, 90e-6)),
        },
    )
    assert collective_latency(m) == {
        "all_to_all": {"group": {"2": pytest.approx(12.0)}, "world": {"4": pytest.approx(30.0)}},
        "all_reduce": {"rail": {"2": pytest.approx(40.0)}},
    }


def test_bad_groups_are_input_errors_naming_the_flag():
    with pytest.raises(ConfigError, match=r"^--groups: 3 groups do not divide 4 ranks evenly"):
        RankLayout.consecutive(4, 3, "--groups")
    with pytest.raises(ConfigError, match="exactly once"):
        sample_pairs([[0, 1], [1, 2]], 3, all_pairs_max_ranks=2)
    with pytest.raises(ConfigError, match="lowest rank"):
        _measurements(["h"] * 4, [[2, 3], [0, 1]], {"intra": 1.0, "inter": 1.0})
    assert issubclass(ProbeError, TopologyError) and issubclass(ProbeError, ValueError)


def test_more_processes_than_gpus_on_a_host_is_one_line_naming_both():
    """Seen on a 1-GPU machine: torchrun --nproc-per-node 2 ended in CUDA's 'invalid device ordinal'."""
    assert [local_gpu(r, 8, 8) for r in (0, 7)] == [0, 7]
    assert local_gpu(0, 1, 4) == 0  # fewer processes than GPUs: fine
    expected = (
        "2 processes on this host but 1 CUDA GPU(s): NCCL needs one GPU per process; launch at most 1 per "
        "host (--nproc-per-node 1), or run on the CPU with gloo (FLEXSHARD_BACKEND=gloo)"
    )
    for local_rank in (0, 1):  # every process of the host says the same
        with pytest.raises(ConfigError) as err:
            local_gpu(local_rank, 2, 1)
        assert str(err.value) == expected
    with pytest.raises(ConfigError, match="^3 processes on this host but 2 CUDA GPU"):
        local_gpu(2, 2, 2)  # a local rank past the GPUs, whatever LOCAL_WORLD_SIZE said


def test_the_launchers_local_rank_and_world_pick_the_gpu(monkeypatch):
    """``launcher_gpu``: torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE, else the default rank and just enough."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert launcher_gpu(1) == 0 and launcher_gpu(4, default_local_rank=3) == 3
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launcher_gpu(2) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="^2 processes on this host but 1 CUDA GPU"):
        launcher_gpu(1)


def test_the_backend_follows_cuda_unless_asked():
    assert [pick_backend(None, cuda) for cuda in (True, False)] == ["nccl", "gloo"]
    assert [pick_backend("auto", True), pick_backend("gloo", True), pick_backend("nccl", True)] == [
        "nccl",
        "gloo",
        "nccl",
    ]
    with pytest.raises(ConfigError, match="^FLEXSHARD_BACKEND: 'nccl' needs CUDA"):
        pick_backend("nccl", False)


def test_all_pairs_on_small_worlds_in_disjoint_rounds():
    pairs = sample_pairs([[0, 1], [2, 3]], 4, all_pairs_max_ranks=16)
    assert pairs == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    rounds = schedule_rounds(pairs)
    assert sorted(p for r in rounds for p in r) == pairs
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))
    assert len(rounds) == 3


def test_sampled_pairs_cover_every_rank_inside_and_outside_its_group():
    groups = RankLayout.consecutive(256, 32).to_lists()
    pairs = sample_pairs(groups, 256, all_pairs_max_ranks=16, seed=3)
    assert pairs == sample_pairs(groups, 256, all_pairs_max_ranks=16, seed=3)  # deterministic
    assert len(pairs) <= 2 * 256
    group_of = {r: k for k, g in enumerate(groups) for r in g}
    for r in range(256):
        mine = [p for p in pairs if r in p]
        assert any(group_of[a] == group_of[b] for a, b in mine)
        assert any(group_of[a] != group_of[b] for a, b in mine)
    assert len(schedule_rounds(pairs)) < 12


# --- graphs from measurements -----------------------------------------------------------------------


def test_measured_graph_reads_back_the_measured_numbers(tmp_path):
    hosts = ["h0"] * 2 + ["h1"] * 2 + ["h2"] * 2 + ["h3"] * 2
    m = _measurements(
        hosts, RankLayout.by_host(hosts).to_lists(), {"intra": 100.0, "inter": 20.0}, slow_ranks={0, 1}
    )
    G = measured_graph(m, name="synthetic")
    view = cluster_view(G)
    assert view.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert np.allclose(view.intra_bw_Bps, 100 * GB, rtol=1e-6)
    assert np.allclose(view.inter_bw_Bps, [5 * GB] * 2 + [20 * GB] * 6, rtol=1e-6)
    assert np.allclose(view.inter_latency_s, 10e-6, rtol=1e-6)  # one way, GPU to GPU
    assert np.allclose(view.intra_latency_s, 3e-6, rtol=1e-6)
    measured = [a for *_, a in G.edges(data=True)]
    assert all(a["measured"] is True and a["measured_by"] == "collective" for a in measured)
    # the slow host: in the measurements and on the graph's edges
    slow = slow_parts(m)
    assert {(s["what"], s["name"]) for s in slow if s["class"] == "p2p/inter"} >= {
        ("host", "h0"),
        ("rank", "0"),
        ("rank", "1"),
    }
    assert {frozenset((s["u"], s["v"])) for s in slow_links(G) if s["kind"] == "network"} == {
        frozenset(("h0/nic0", "leaf0")),
        frozenset(("h0/nic1", "leaf0")),
    }
    assert [e["class"] for e in G.nodes["h0"]["slow"]] == ["p2p/inter"]
    assert G.nodes["h0/gpu1"]["slow"][0]["bandwidth_GBps"] == pytest.approx(5.0)
    assert "slow" not in G.nodes["h1"] and "slow" not in G.nodes["h1/gpu0"]
    text = probe_report(m)
    assert "p2p/inter" in text and "host h0" in text and "all_to_all/world" in text
    path = tmp_path / "probe.json"
    write_json(G, path)
    back = read_json(path)
    assert back.graph["probe"]["groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert back.graph["probe"]["pairs"]["0-1"]["bandwidth_GBps"] == pytest.approx(100.0)


def test_single_group_has_no_network_and_groups_of_one_get_defaults():
    m = _measurements(["h"] * 3, [[0, 1, 2]], {"intra": 40.0, "inter": 0.0})
    view = cluster_view(measured_graph(m))
    assert view.num_groups == 1 and np.allclose(view.inter_bw_Bps, 0.0)
    lone = _measurements(["a", "b", "b"], [[0], [1, 2]], {"intra": 40.0, "inter": 10.0})
    G = measured_graph(lone)
    assert cluster_view(G).intra_bw_Bps[0] == pytest.approx(40 * GB)  # borrowed median
    assert G.edges["a/gpu0", "nvswitch/g0"]["measured"] is False
    assert rank_links(lone)[0].intra_GBps is None


def test_hosts_cores_reach_the_graph_the_view_and_the_report(tmp_path):
    """4 ranks on host a, each free to run on cores {0, 1} but one only on {1}: a's host node says 2 cores
    (the union of its ranks' masks), the view 4 / 2 = 2 ranks a core; 2 ranks on host b pinned to 4 cores
    each, {0-3} and {4-7}: 8 cores (0.25 ranks a core is not the most). Both reports say so; a file keeps
    it; ranks that said nothing leave the hosts without ``cores`` and the view at 1."""
    hosts = ["a"] * 4 + ["b"] * 2
    m = _measurements(hosts, [[0, 1, 2, 3], [4, 5]], {"intra": 40.0, "inter": 10.0})
    cpus = [(0, 1), (1,), (0, 1), (0, 1), (0, 1, 2, 3), (4, 5, 6, 7)]
    m = dataclasses.replace(
        m, ranks=tuple(dataclasses.replace(i, cpus=c) for i, c in zip(m.ranks, cpus, strict=True))
    )
    G = measured_graph(m)
    assert (G.nodes["a"]["cores"], G.nodes["b"]["cores"]) == (2, 8)
    assert cluster_view(G).ranks_per_core == 2.0
    assert "6 ranks on 2 hosts (up to 2 ranks a CPU core)" in probe_report(m)
    assert "up to 2 ranks a CPU core" in topology_summary(G)
    write_json(G, tmp_path / "t.json")
    assert cluster_view(read_json(tmp_path / "t.json")).ranks_per_core == 2.0
    quiet = _measurements(hosts, [[0, 1, 2, 3], [4, 5]], {"intra": 40.0, "inter": 10.0})
    G = measured_graph(quiet)
    assert "cores" not in G.nodes["a"] and cluster_view(G).ranks_per_core == 1.0
    assert "a CPU core" not in probe_report(quiet) and "a CPU core" not in topology_summary(G)


def test_nvml_graph_restricted_to_the_job_then_measured():
    probes = [probe_host(fake_nvswitch_node(4, tag=t), host=h) for t, h in (("1", "a"), ("2", "b"))]
    base = merge_hosts(probes)
    bus = {h: [base.nodes[f"{h}/gpu{i}"]["bus_id"] for i in range(4)] for h in ("a", "b")}
    # the job: GPUs 2 and 3 of each host (matched by bus id), torch ranks 0..3
    infos = [
        RankInfo(r, h, i, f"cuda:{i}", bus[h][i + 2], 80 * 2**30, "H100")
        for r, (h, i) in enumerate([("a", 0), ("a", 1), ("b", 0), ("b", 1)])
    ]
    job = restrict_to_job(base, infos)
    assert sorted(n for n, a in job.nodes(data=True) if a["kind"] == "gpu") == [
        "a/gpu2",
        "a/gpu3",
        "b/gpu2",
        "b/gpu3",
    ]
    assert [job.nodes[n]["rank"] for n in ("a/gpu2", "a/gpu3", "b/gpu2", "b/gpu3")] == [0, 1, 2, 3]
    assert "a/nic0" not in job
    m = _measurements(["a", "a", "b", "b"], [[0, 1], [2, 3]], {"intra": 300.0, "inter": 40.0})
    G = measured_graph(m, job)
    view = cluster_view(G)
    assert np.allclose(view.intra_bw_Bps, 300 * GB, rtol=1e-6)
    assert np.allclose(view.inter_bw_Bps, 40 * GB, rtol=1e-6)
    edge = G.edges["a/gpu2", "nvswitch/a"]
    assert edge["measured"] is True and edge["nominal_GBps"] == pytest.approx(450.0)
    assert G.edges["a/nic2", "leaf0"]["nominal_GBps"] == pytest.approx(50.0)
    # a rank whose GPU NVML does not list: the caller falls back to measurements alone
    assert restrict_to_job(base, [*infos[:3], RankInfo(3, "zzz", 0, "cuda:0", None, 1, "H100")]) is None


# --- bounded waits ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_rendezvous_names_the_rank_that_never_joins():
    start = time.monotonic()
    with pytest.raises(ProbeError, match=r"rank 1 of 2 did not join within 1 s \(joined: 0\)"):
        rendezvous(0, 2, "127.0.0.1", free_port(), 1.0)
    assert time.monotonic() - start < 60  # bounded by the timeout, with room for a loaded machine


def test_measure_needs_an_initialised_job():
    from topology.probe import measure

    with pytest.raises(ProbeError, match="not initialised"):
        measure([[0]])


def _join(rank: int, world: int, port: int, timeout_s: float, join_s: float = 60.0) -> object:
    """This spawned rank in a gloo probe job on loopback, the probe's own way (``join_s`` seconds for the
    others to start, ``timeout_s`` for every later wait); returns the store."""
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    from topology.probe import init_probe_group

    store = rendezvous(rank, world, "127.0.0.1", port, join_s)
    init_probe_group(rank, world, store, timeout_s, "gloo")
    return store


def _spawn(target, world: int, *args) -> tuple[list, object]:
    """``world`` spawned processes running ``target(rank, port, results, *args)``; (processes, results)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, results, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return procs, results


def _end(procs) -> None:
    for p in procs:
        p.kill()
        p.join(timeout=5)


def _silent_after_join(rank: int, port: int, results) -> None:
    """Rank 1 joins and exchanges its info, then never answers; rank 0 measures and must fail naming it."""
    from topology.probe import gather_rank_info, measure

    store = _join(rank, 2, port, 2.0)
    infos = gather_rank_info(2.0, store)
    if rank == 1:
        time.sleep(30)
        os._exit(0)
    start = time.monotonic()
    try:
        measure([[0, 1]], ProbeConfig.quick(timeout_s=2.0), infos=infos, store=store)
        results.put(("finished", 0.0))
    except ProbeError as err:
        results.put((str(err), time.monotonic() - start))
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.slow
def test_a_rank_that_stops_answering_is_named_within_the_timeout():
    procs, results = _spawn(_silent_after_join, 2)
    try:
        message, elapsed = results.get(timeout=60)
    finally:
        _end(procs)
    assert "rank 1 never reached it" in message and "within 2 s" in message, message
    assert "\n" not in message
    assert elapsed < 2 + 60  # the timeout plus room for a loaded machine, never a hang


def _sampled_probe(rank: int, port: int, results) -> None:
    """Every rank: a real probe of 6 gloo ranks in 3 groups, forced to sample pairs (all pairs only up
    to 2 ranks), with small messages; puts (rank, Measurements or traceback). Rank 0 hosts the store, so
    it leaves last."""
    import traceback

    from topology.probe import measure

    try:
        store = _join(rank, 6, port, 60.0)
        config = ProbeConfig(
            sizes=(4096, 65536), repeats=2, warmup=1, timeout_s=60.0, all_pairs_max_ranks=2, seed=5
        )
        results.put((rank, measure([[0, 1], [2, 3], [4, 5]], config, store=store)))
        store.set(f"test/done/{rank}", "1")
        if rank == 0:
            store.wait([f"test/done/{r}" for r in range(6)])
    except BaseException:
        results.put((rank, traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)


@pytest.mark.slow
def test_sampled_pairs_probe_on_six_real_ranks():
    """The sampled-pairs mode of large clusters, run for real: only the sampled pairs are timed, every
    rank gets an intra- and an inter-group measurement, and the graph made from them has a measured
    bandwidth on every rank's path."""
    procs, queue = _spawn(_sampled_probe, 6)
    try:
        got = dict(queue.get(timeout=240) for _ in range(6))
    finally:
        _end(procs)
    failed = [text for text in got.values() if isinstance(text, str)]
    assert not failed, failed[0]
    results = [got[r] for r in range(6)]
    m = results[0]
    groups = [[0, 1], [2, 3], [4, 5]]
    expected = sample_pairs(groups, 6, all_pairs_max_ranks=2, seed=5)
    assert sorted(m.pairs) == expected and len(expected) < 15  # a sample, not all 15 pairs
    assert all(sorted(r.pairs) == expected for r in results)  # the same measurements on every rank
    layout = RankLayout.of(groups)
    for r in range(6):
        mine = [(a, b) for a, b in expected if r in (a, b)]
        assert any(layout.link_class(a, b) == LinkClass.INTRA_GROUP for a, b in mine)
        assert any(layout.link_class(a, b) == LinkClass.INTER_GROUP for a, b in mine)
    assert all(f.bandwidth_GBps > 0 for f in m.pairs.values())
    G = measured_graph(m, name="sampled")
    assert all(a["measured"] is True for *_, a in G.edges(data=True))  # no default left on any path
    view = cluster_view(G)
    assert view.groups == ((0, 1), (2, 3), (4, 5))
    assert (view.intra_bw_Bps > 0).all() and (view.inter_bw_Bps > 0).all()
    # each rank said the CPUs it may run on (every rank's local rank numbered on this one host)
    assert [(i.local_rank, i.cpus) for i in m.ranks] == [(r, usable_cpus()) for r in range(6)]
    assert view.ranks_per_core == pytest.approx(6 / len(usable_cpus()))
