"""``core.osutil.free_port``: a rendezvous port outside the kernel's ephemeral range (where the kernel may
hand a just-released port to any outgoing connection), free to listen on."""

from __future__ import annotations

import socket

from core import osutil


def test_free_ports_are_below_the_ephemeral_range_and_bindable():
    low = osutil._ephemeral_low()
    ports = {osutil.free_port() for _ in range(20)}
    if low > osutil.FIXED_PORTS_FROM + 1000:
        assert all(osutil.FIXED_PORTS_FROM <= p < low for p in ports), (low, sorted(ports))
        assert len(ports) > 1  # random, not one fixed port
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_a_taken_port_is_not_returned(monkeypatch):
    """Random choices that are taken are skipped."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(osutil, "_ephemeral_low", lambda: busy + 2)
        monkeypatch.setattr(osutil, "FIXED_PORTS_FROM", busy - 2000)
        seen = {osutil.free_port() for _ in range(200)}
        assert busy not in seen


class _Always:
    """A stand-in for ``random.SystemRandom`` whose every choice is one port."""

    port = 0

    def randrange(self, _start: int, _stop: int) -> int:
        return self.port


def test_a_port_is_never_handed_out_twice(monkeypatch):
    """The random choice repeats one port: the second call must not return it again (it falls back to
    the kernel's choice), and many calls are all distinct."""
    monkeypatch.setattr(osutil, "_HANDED_OUT", set())
    first = osutil.free_port()
    monkeypatch.setattr(osutil.random, "SystemRandom", lambda: _Always())
    _Always.port = first
    again = [osutil.free_port() for _ in range(5)]
    assert first not in again
    assert len(set(again)) == 5
    monkeypatch.undo()
    monkeypatch.setattr(osutil, "_HANDED_OUT", set())
    ports = [osutil.free_port() for _ in range(300)]
    assert len(set(ports)) == 300


def test_the_kernels_choice_is_not_repeated_either(monkeypatch):
    """With no room below the ephemeral range the kernel picks (bind to 0), and may pick a port it picked
    before; free_port still never returns one twice."""
    monkeypatch.setattr(osutil, "_HANDED_OUT", set())
    monkeypatch.setattr(osutil, "_ephemeral_low", lambda: osutil.FIXED_PORTS_FROM)
    ports = [osutil.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert set(ports) == osutil._HANDED_OUT
