"""Feature extraction and the cost model on a hybrid target (Qwen3.5): anchor states and the
target's argmax equal Hugging Face's; every timed piece runs (rolled back within its ring)."""
import torch
from conftest import make_tiny_hybrid

from spd.evaluation.cost_model import measure_costs
from spd.train.distill import sequence_features


def test_hybrid_sequence_features_match_hugging_face():
    t = make_tiny_hybrid(seed=8, vocab=32)
    ids = torch.randint(0, 32, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    states, final, argmax = sequence_features(t, ids, [0, 2, 3])
    with torch.no_grad():
        ref = t.hf(torch.tensor([ids]), output_hidden_states=True)
    for j, b in enumerate([0, 2, 3]):
        torch.testing.assert_close(states[j], ref.hidden_states[b][0], rtol=1e-4, atol=1e-5)
    assert argmax.tolist() == ref.logits[0].argmax(-1).tolist()


def test_cost_model_runs_on_a_hybrid_target():
    t = make_tiny_hybrid(seed=8, vocab=32)
    costs = measure_costs(t, [2], chunk_rows=(4,), context=16, reps=1)
    assert costs.forward_s > 0 and len(costs.stage_s["2"]) == 2 and costs.chunk_s["4"] > 0
