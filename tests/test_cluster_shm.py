"""Stale /dev/shm segments (libra_hpc/cluster/shm.py): only this user's, of the kinds a
job makes, old enough, and mapped or held open by no live process. A fake /proc and
/dev/shm in tmp_path, and one real check against this machine's /proc."""

from __future__ import annotations

import mmap
import os

from libra_hpc.cluster.shm import in_use, remove_stale, stale

NOW = 1_000_000.0


def test_only_this_users_old_unused_segments_of_a_known_kind_are_stale():
    entries = [("psm_dead", 1000, NOW - 600), ("mpich_shm_1_0", 1000, NOW - 600), ("torch_7_x", 1000, NOW - 61),
               ("psm_live", 1000, NOW - 600),       # a live process maps it
               ("psm_new", 1000, NOW - 5),          # being created
               ("psm_theirs", 1001, NOW - 600),     # another user's
               ("sem.mine", 1000, NOW - 600)]       # not a kind a job makes
    assert stale(entries, uid=1000, used={"psm_live"}, now=NOW) == ["mpich_shm_1_0", "psm_dead", "torch_7_x"]
    assert stale(entries, uid=1000, used=set(), now=NOW, min_age_s=0) == [
        "mpich_shm_1_0", "psm_dead", "psm_live", "psm_new", "torch_7_x"]


def _fake_proc(root, maps: dict[int, str], fds: dict[int, list[str]]):
    for pid in set(maps) | set(fds):
        (root / str(pid) / "fd").mkdir(parents=True)
        (root / str(pid) / "maps").write_text(maps.get(pid, ""))
        for k, target in enumerate(fds.get(pid, [])):
            os.symlink(target, root / str(pid) / "fd" / str(k))
    (root / "self").mkdir()  # not a pid: skipped


def test_a_segment_mapped_or_open_in_a_live_process_is_in_use(tmp_path):
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    _fake_proc(proc, maps={10: f"7f00-7f10 rw-s 00000000 00:1a 42 {shm}/psm_mapped\n7f10-7f20 rw-p 00000000 00:00 0 \n"
                               f"7f20-7f30 rw-s 00000000 00:1a 43 {shm}/psm_gone (deleted)\n"},
               fds={11: [f"{shm}/mpich_shm_open_0", "/etc/hosts"]})
    assert in_use(proc, shm) == {"psm_mapped", "psm_gone", "mpich_shm_open_0"}


def test_remove_stale_unlinks_what_no_one_uses_and_says_how_much(tmp_path):
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    shm.mkdir()
    for name, size in (("psm_dead", 4096), ("psm_mapped", 10), ("notes.txt", 3)):
        (shm / name).write_bytes(b"x" * size)  # written: its blocks are allocated
        os.utime(shm / name, (NOW - 600, NOW - 600))
    _fake_proc(proc, maps={10: f"7f00-7f10 rw-s 00000000 00:1a 42 {shm}/psm_mapped\n"}, fds={})
    with (shm / "sem.mp-sparse").open("wb") as f:  # a sparse segment holds the blocks it wrote, not its size
        f.truncate(1 << 30)
    os.utime(shm / "sem.mp-sparse", (NOW - 600, NOW - 600))
    assert remove_stale(shm, proc=proc, clock=lambda: NOW, dry_run=True) == (["psm_dead", "sem.mp-sparse"], 4096)
    assert (shm / "psm_dead").exists()
    assert remove_stale(shm, proc=proc, clock=lambda: NOW) == (["psm_dead", "sem.mp-sparse"], 4096)
    assert sorted(p.name for p in shm.iterdir()) == ["notes.txt", "psm_mapped"]
    assert remove_stale(tmp_path / "no-such-dir", proc=proc) == ([], 0)


def test_this_process_mapping_a_real_segment_keeps_it(tmp_path):
    """The real /proc: a segment this test maps is in use; once unmapped and closed it is not."""
    path = tmp_path / "psm_test_segment"
    path.write_bytes(b"\0" * 4096)
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 4096) as m:
        m[0] = 1
        assert "psm_test_segment" in in_use(shm=tmp_path)
    assert "psm_test_segment" not in in_use(shm=tmp_path)


def test_one_rank_per_node_cleans(monkeypatch):
    """Rank 0 for its node (node 0), the first rank of every other node; on emulated nodes
    (one host) rank 0 alone."""
    from types import SimpleNamespace

    import libra_hpc.cluster.shm as shm
    from libra_hpc.run import _remove_stale_shm

    cleaned = []
    monkeypatch.setattr(shm, "remove_stale", lambda: cleaned.append(rank) or ([], 0))

    def slot(r):
        return SimpleNamespace(slot=SimpleNamespace(node=(r - 1) // 2, gpu=(r - 1) % 2))

    for emulated, want in ((False, [0, 3, 5]), (True, [0])):
        cleaned.clear()
        for rank in range(7):  # 3 nodes × 2 GPUs
            world = SimpleNamespace(rank=rank, topology=SimpleNamespace(emulated=emulated, place_of=slot))
            _remove_stale_shm(world, None)
        assert cleaned == want
