"""CPU tests of checkpoint.py's snapshots (a checkpoint written by a run: test_train_dflash.py)."""
import torch


def test_checkpoint_snapshots_reuse_their_host_buffers_and_never_alias_the_live_tensors():
    """The snapshot's host buffers are the same from one checkpoint to the next (no ~15 GB allocated per
    checkpoint), hold copies (training on does not change them), keep a tensor shared in the state
    shared (written once), and are replaced where a tensor's shape or dtype changed."""
    import checkpoint as ck
    w, m = torch.arange(6.0), torch.ones(2, 3)
    pool = ck.HostPool()
    first = ck.to_host({"w": w, "opt": [w, m], "n": 3}, {}, pool.start())
    pool.finish()
    assert first["w"] is first["opt"][0] and first["n"] == 3
    assert first["w"].data_ptr() != w.data_ptr() and torch.equal(first["w"], w)
    kept = [t.data_ptr() for t in pool.bufs]
    w += 1                                                  # training goes on
    assert torch.equal(first["w"], torch.arange(6.0))
    second = ck.to_host({"w": w, "opt": [w, m], "n": 3}, {}, pool.start())
    pool.finish()
    assert [t.data_ptr() for t in pool.bufs] == kept        # the same buffers, refilled
    assert torch.equal(second["w"], torch.arange(6.0) + 1) and torch.equal(second["opt"][1], m)
    third = ck.to_host({"w": w.double(), "opt": [m]}, {}, pool.start())
    assert third["w"].dtype == torch.float64 and pool.bufs[0].data_ptr() != kept[0]
    assert torch.equal(third["opt"][0], m)
