"""The grace before a node's "offline" reaches its jobs (gateway/job/offline.py): pure, on a clock of ours."""

from xronos.gateway.job.offline import OfflineGrace


def test_an_offline_counts_after_the_short_grace_unless_withdrawn():
    g = OfflineGrace(short_s=2.0, settle_s=30.0)
    g.reconnected(0.0)
    g.offline("a", 100.0)
    g.offline("b", 100.0)
    assert g.due(101.9, connected=True) == []
    g.online("b")
    assert g.due(102.0, connected=True) == ["a"]
    assert g.due(200.0, connected=True) == []  # told once


def test_nothing_counts_while_the_gateway_is_disconnected_and_a_reconnect_gives_the_nodes_time():
    g = OfflineGrace(short_s=2.0, settle_s=30.0)
    g.reconnected(0.0)
    g.offline("a", 100.0)  # a broker shutting down: the wills, then our own connection goes
    assert g.due(150.0, connected=False) == []
    g.reconnected(160.0)
    assert g.due(189.9, connected=True) == []
    assert g.due(190.0, connected=True) == ["a"]  # it never came back


def test_an_offline_heard_just_after_a_reconnect_waits_for_the_settle_time():
    g = OfflineGrace(short_s=2.0, settle_s=30.0)
    g.reconnected(50.0)
    g.offline("a", 51.0)  # a retained will a persistent broker kept over its restart
    assert g.due(79.9, connected=True) == []
    g.online("a")  # the node reconnected and said online again
    assert g.due(1000.0, connected=True) == []
