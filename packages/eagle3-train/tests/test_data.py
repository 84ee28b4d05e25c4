"""Data loading: deterministic plans, disjoint equal rank shares, worker-count independence,
exact rows (float32 and bfloat16 storage), stable held-out split."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3_schemas.io.safetensors_format import read_safetensors
from eagle3_train.data.dataset import (
    HiddenStateDataset,
    is_validation,
    plan_epoch,
    rank_batches,
    split_indices,
)
from eagle3_train.data.loader import RingSlotBusy, ShardReader, make_loader, to_device

from support.synthetic_states import write_dataset


def test_plan_is_deterministic_bounded_and_reshuffled_per_epoch():
    lengths = np.array([40, 7, 130, 64, 1, 90, 33, 12, 80, 55])
    idx = np.arange(len(lengths))
    a = plan_epoch(lengths, idx, 128, seed=3, epoch=0)
    assert a == plan_epoch(lengths, idx, 128, seed=3, epoch=0)
    assert a != plan_epoch(lengths, idx, 128, seed=3, epoch=1)
    assert a != plan_epoch(lengths, idx, 128, seed=4, epoch=0)
    for batch in a:
        assert sum(n for _, n in batch) <= 128
    taken = {i: n for batch in a for i, n in batch}
    assert 4 not in taken  # a one-token sample has nothing to predict
    assert taken[2] == 128  # longer samples keep their prefix
    assert sorted(taken) == [0, 1, 2, 3, 5, 6, 7, 8, 9]


def test_rank_shares_are_disjoint_and_equal():
    plan = [[(i, 10)] for i in range(11)]
    shares = [rank_batches(plan, r, 3) for r in range(3)]
    assert [len(s) for s in shares] == [3, 3, 3]
    seen = [i for s in shares for b in s for i, _ in b]
    assert len(seen) == len(set(seen)) == 9


@pytest.fixture(scope="module")
def bf16_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16") / "hs"
    return write_dataset(
        root, num_samples=24, min_len=8, max_len=40, samples_per_shard=7, storage_dtype="bfloat16"
    )


def test_reader_copies_exact_rows_in_storage_dtype(bf16_dataset):
    ds = HiddenStateDataset(bf16_dataset)
    plan = [(5, ds.num_tokens[5]), (17, 6), (0, ds.num_tokens[0])]
    batch = ShardReader(ds).read(plan)
    assert batch["aux_hidden_states"].dtype == torch.bfloat16
    assert batch["cu_seqlens"].tolist() == [
        0,
        ds.num_tokens[5],
        ds.num_tokens[5] + 6,
        sum(n for _, n in plan),
    ]
    assert batch["sample_ids"] == [ds.sample_ids[5], ds.sample_ids[17], ds.sample_ids[0]]
    pos = 0
    for idx, n in plan:
        st = read_safetensors(ds.shard_paths[ds.shard_of[idx]])
        r = int(ds.row_start[idx])
        for name in ("aux_hidden_states", "last_hidden_state", "input_ids", "loss_mask"):
            want = np.asarray(st.array(name)[r : r + n])
            got = batch[name][pos : pos + n]
            got = got.view(torch.uint16).numpy() if got.dtype == torch.bfloat16 else got.numpy()
            np.testing.assert_array_equal(
                got, want.astype(got.dtype), err_msg=f"{name} sample {idx}"
            )
        pos += n


def test_stream_order_does_not_depend_on_worker_count(bf16_dataset):
    ds = HiddenStateDataset(bf16_dataset)
    plan = plan_epoch(ds.num_tokens, np.arange(len(ds)), 64, seed=0, epoch=0)
    one = [b["sample_ids"] for b in make_loader(ds, plan, 0)]
    two = [b["sample_ids"] for b in make_loader(ds, plan, 2)]
    assert one == two == [[ds.sample_ids[i] for i, _ in b] for b in plan]


def _digest(batch) -> tuple:
    return tuple(
        hash(batch[k].view(torch.uint8).numpy().tobytes())
        if batch[k].dtype == torch.bfloat16
        else hash(batch[k].numpy().tobytes())
        for k in ("aux_hidden_states", "last_hidden_state", "input_ids", "loss_mask", "cu_seqlens")
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_recycled_buffers_give_the_same_batches_when_consumed_in_order(bf16_dataset, workers):
    """A training loop finishes with a batch before fetching the next: recycling buffers
    (in-process and through worker shared memory) must then yield exactly the fresh batches."""
    ds = HiddenStateDataset(bf16_dataset)
    plan = plan_epoch(ds.num_tokens, np.arange(len(ds)), 48, seed=1, epoch=0)
    fresh = [_digest(b) for b in make_loader(ds, plan, 0)]
    recycled = []
    for b in make_loader(ds, plan, workers, prefetch=2, recycle=True):
        recycled.append(_digest(b))
        b["lease"].release()
    assert len(plan) > 8 and recycled == fresh


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_a_ring_slot_is_not_refilled_before_its_batch_is_released(bf16_dataset, workers):
    """The reuse rule of the recycled ring (the trainer's: 1 worker, prefetch 2, 4 slots):
    a slot is refilled only after the batch read into it was released — by to_device, which
    on CUDA fences the release with an event after the batch's copies, so a host running
    steps ahead of the GPU cannot overwrite rows a pending copy still reads. A consumer that
    never releases is stopped at the first refill, naming the slot; one that releases a
    batch after its slot was refilled is stopped too."""
    ds = HiddenStateDataset(bf16_dataset)
    plan = plan_epoch(ds.num_tokens, np.arange(len(ds)), 48, seed=1, epoch=0)
    ring = workers * 2 + 2
    seen = 0
    with pytest.raises(RingSlotBusy, match="ring slot 0 is due to be refilled"):
        for _ in make_loader(ds, plan, workers, prefetch=2, recycle=True):
            seen += 1  # held: never released
    assert seen == ring  # every slot lent once; the first refill stops the stream

    cpu = torch.device("cpu")
    fresh = [_digest(to_device(b, cpu)) for b in make_loader(ds, plan, 0)]
    kept, got = [], []
    for b in make_loader(ds, plan, workers, prefetch=2, recycle=True):
        got.append(_digest(to_device(b, cpu)))  # the trainer's release
        kept.append(b)
    assert len(plan) > 8 and got == fresh
    with pytest.raises(RingSlotBusy, match="released after its ring slot was refilled"):
        kept[0]["lease"].release()


def test_validation_split_is_stable_and_about_the_fraction(bf16_dataset):
    ds = HiddenStateDataset(bf16_dataset)
    train, val = split_indices(ds, 0.25)
    assert len(train) + len(val) == len(ds) and not set(train) & set(val)
    assert [is_validation(f"s-{i}", 0.1) for i in range(2000)].count(True) in range(150, 250)
    assert split_indices(ds, 0.25)[1].tolist() == val.tolist()


def test_the_events_of_one_conversation_are_held_out_together() -> None:
    """tokenize writes a thinking or agent conversation as samples ID#0, ID#1, ... that share
    its prompt prefix: a split between them would leak it into the validation loss."""
    ids = [f"{i:032x}" for i in range(400)]
    held = [is_validation(i, 0.25) for i in ids]
    assert 0 < sum(held) < len(ids)
    for conversation, out in zip(ids, held, strict=True):
        assert [is_validation(f"{conversation}#{k}", 0.25) for k in range(3)] == [out] * 3
