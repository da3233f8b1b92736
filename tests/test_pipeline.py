"""CPU tests of pipeline.py's process group set-up (runs over ranks: test_train_dflash.py)."""
import pytest
import torch


def test_nccl_rank_sets_its_gpu_before_the_process_group_starts(monkeypatch):
    """On GPUs (NCCL) each torchrun rank must select cuda:LOCAL_RANK before init_process_group, and name
    it as the group's device: else every rank's collectives run on cuda:0 and NCCL fails ("invalid
    usage"). CPU CI has no NCCL, so the calls are recorded instead of made."""
    import torch.distributed as dist
    import config
    import train_dflash as tr
    calls = []

    class Started(Exception):
        pass

    def init_process_group(backend, **kw):
        calls.append(("init_process_group", backend, kw))
        raise Started
    for k, v in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(Started):
        tr.Trainer(config.parse_args([]), log=lambda m: None).setup()
    assert calls == [("set_device", 1), ("init_process_group", "nccl", {"device_id": torch.device("cuda", 1)})]
