"""pack / unpack (serving/engine/step_buffers.py): a step's arrays as one flat buffer per
dtype and back, the layout from a plan kept per shape and names, and a step that does not
fit its plan laid out afresh (so the runner refuses it). No JAX."""
import numpy as np

from serving.engine.input_prep import padding_step, prepare
from serving.engine.step_buffers import _laid_out, pack, unpack
from tests.test_input_prep import BUCKETS, MAX_SEQS, PAGE, mixed_step


def assert_round_trip(arrays):
    buffers, layout = pack(arrays)
    want_buffers, want_layout = _laid_out(arrays)
    assert layout == want_layout
    for b, w in zip(buffers, want_buffers, strict=True):
        assert b.dtype == w.dtype
        np.testing.assert_array_equal(b, w)
    batch, sampling = unpack(buffers, layout)
    for got, want in ((batch, arrays.batch), (sampling, arrays.sampling)):
        assert got.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
            assert got[name].dtype == np.asarray(value).dtype and got[name].shape == np.shape(value)


def test_steps_round_trip_through_their_plans():
    for _ in range(2):  # the first lays out and keeps a plan, the second uses it
        assert_round_trip(prepare(mixed_step(), BUCKETS, PAGE, MAX_SEQS))
        for shape in ((8, 2, 4), (32, 8, 16)):
            assert_round_trip(padding_step(shape))


def test_arrays_that_do_not_fit_the_plan_are_laid_out_afresh():
    arrays = padding_step((16, 4, 8))
    _, layout = pack(arrays)
    wider = padding_step((16, 4, 8))
    wider.batch["input_ids"] = np.zeros(16, np.int64)  # a dtype the program does not take
    buffers, other = pack(wider)
    assert other != layout and ("batch", "input_ids", "<i8", (16,), 0) in other
    assert_round_trip(wider)
    short = padding_step((16, 4, 8))
    short.batch["positions"] = np.zeros(15, np.int32)  # a shape it does not take
    assert pack(short)[1] != layout
    assert pack(padding_step((16, 4, 8)))[1] == layout  # the plan still serves the rest


def test_a_plan_per_shape_and_names():
    a = padding_step((8, 2, 4))
    lora = padding_step((8, 2, 4))
    lora.batch["lora_slots"] = np.full(8, -1, np.int32)
    assert pack(a)[1] != pack(lora)[1]
    assert_round_trip(lora)
