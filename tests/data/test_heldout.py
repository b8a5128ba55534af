"""The project's held-out prompt set: present, well formed, and kept out of every training path."""
from collections import Counter

from spd.data.datasets import contains_eval_prompt, eval_prompt_keys, load_dataset


def test_heldout_set_loads_and_is_excluded_from_training_data():
    qs = load_dataset("heldout")
    assert Counter(q["category"] for q in qs) == {"chat": 12, "code": 12, "math": 8,
                                                  "multilingual": 4}
    assert len({q["turns"][0] for q in qs}) == len(qs)
    keys = eval_prompt_keys()
    assert keys >= eval_prompt_keys(("heldout",))
    for q in qs:  # a training conversation that holds one is dropped
        conv = [{"role": "user", "content": "  " + q["turns"][0].upper() + "\n"},
                {"role": "assistant", "content": "an answer"}]
        assert contains_eval_prompt(conv, keys)
    assert not contains_eval_prompt([{"role": "user", "content": "Name three rivers."}], keys)
