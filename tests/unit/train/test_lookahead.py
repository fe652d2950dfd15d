"""``train.lookahead``: prompts drawn ahead, and the data position a checkpoint saves."""

from loggra_megatron.data.prompts import PromptDataset
from loggra_megatron.train.lookahead import PromptLookahead


def _dataset() -> PromptDataset:
    return PromptDataset([{"prompt": f"q{i}", "answer": str(i)} for i in range(20)], seed=3)


def test_steps_ahead_come_back_in_order_and_a_save_resumes_before_them():
    data = _dataset()
    stream = data.batches(4)
    ahead = PromptLookahead(data, lambda: next(stream), global_prompts_per_step=4)
    first = ahead.take()
    drawn = ahead.extend_to(2)  # steps 2 and 3 drawn during step 1
    assert len(drawn) == 2 and ahead.extend_to(2) == []
    assert data.consumed_samples == 12 and ahead.state_dict()["consumed_samples"] == 4
    assert ahead.take() == drawn[0] and ahead.take() == drawn[1]
    assert ahead.state_dict() == data.state_dict()
    # a resume from the saved position draws the steps that were in flight again
    again = _dataset()
    saved = PromptLookahead(data, lambda: None, 4)
    data.consumed_samples = 12
    saved.queue.extend(drawn)
    state = saved.state_dict()
    resumed = PromptLookahead(again, None, 4)
    resumed.load_state_dict(state)
    replay = again.batches(4)
    assert [e["index"] for e in next(replay)] == [e["index"] for e in drawn[0]]
    assert first != drawn[0]
