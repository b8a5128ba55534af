"""The training methods `spd train` offers (spd.baselines.training): each --method choice is one
`TrainMethod`, with its defaults and refusals; what is trained can be evaluated."""
import pytest

from spd.baselines import eagle_train, ppsd, training
from spd.baselines.eagle import default_feature_layers
from spd.cli.main import build_parser
from spd.errors import SPDError
from spd.evaluation import methods as grid_methods
from spd.train.methods import SPD, Refusal, TrainMethod, train_pdm


def _method_action():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return next(a for a in sub.choices["train"]._actions if a.dest == "method")


def _options(*argv):
    return build_parser().parse_args(["train", "--out", "x", *argv])


def test_every_method_choice_is_a_registry_entry():
    action = _method_action()
    assert tuple(action.choices) == training.NAMES == ("spd", "ppsd", "eagle3")
    assert action.default == training.DEFAULT == "spd"
    for name in action.choices:
        m = training.get(name)
        assert isinstance(m, TrainMethod) and m.name == name
        assert f"{name}{' (default)' if name == 'spd' else ''}: {m.summary}" in action.help
    with pytest.raises(SPDError, match="unknown training method 'medusa'"):
        training.get("medusa")


def test_what_is_trained_can_be_evaluated():
    """Each trained drafter's name is a grid method (its checkpoints carry that name)."""
    assert set(training.NAMES) <= set(grid_methods.NAMES)


def test_each_method_sets_its_defaults():
    assert training.get("spd") is SPD and training.get("ppsd") is ppsd.TRAIN
    assert training.get("eagle3") is eagle_train.TRAIN
    assert (SPD.feature_timing, SPD.pdm_layers, SPD.anchors, SPD.train) == \
        ("pre-step", 2, None, train_pdm)
    p = ppsd.TRAIN
    assert (p.feature_timing, p.pdm_layers, p.train) == ("post-step", 1, train_pdm)
    assert p.anchors(30, 4, None) == [0, 8] and p.anchors(30, 2, [10, 20]) == [0, 10]
    e = eagle_train.TRAIN
    assert e.train is not train_pdm and e.feature_layers(30) == default_feature_layers(30)
    assert list(SPD.feature_layers(30)) == list(p.feature_layers(30)) == []


def test_only_eagle3_refuses_the_pdm_options():
    assert SPD.refused() == ppsd.TRAIN.refused() == set()
    assert eagle_train.TRAIN.refused() == {"fill_weights", "argmax_weight", "init_from",
                                           "pdm_layers", "feature_timing",
                                           "draft_vocab_coverage"}
    pdm_only = _options("--fill-weights", "1,1", "--argmax-weight", "0.5", "--init-from", "c",
                        "--pdm-layers", "3", "--feature-timing", "post-step")
    SPD.check_options(pdm_only)
    ppsd.TRAIN.check_options(pdm_only)
    eagle_train.TRAIN.check_options(_options("--method", "eagle3"))


@pytest.mark.parametrize("argv, message", [
    (("--fill-weights", "1,1"),
     "--fill-weights is a PDM option; the eagle3 head has no fill levels"),
    (("--fill-weights", ""),   # given, even empty
     "--fill-weights is a PDM option; the eagle3 head has no fill levels"),
    (("--argmax-weight", "1"),
     "--argmax-weight must be >= 0 and is a PDM option, got 1.0 with --method eagle3"),
    (("--argmax-weight", "-0.5"),
     "--argmax-weight must be >= 0 and is a PDM option, got -0.5 with --method eagle3"),
    (("--pdm-layers", "2"), "--init-from, --pdm-layers and --feature-timing are PDM options; "
     "the eagle3 head has one layer and drafts in a chain"),
    (("--init-from", "ckpt"), "--init-from, --pdm-layers and --feature-timing are PDM options"),
    (("--feature-timing", "pre-step"), "--init-from, --pdm-layers and --feature-timing are PDM"),
    (("--ttt-steps", "0"), "--ttt-steps must be >= 1, got 0"),
    (("--draft-vocab-coverage", "0.99"), "--draft-vocab-coverage is a PDM option"),
    # refusals in their order: the fill levels first, then the loss, then the PDM's shape
    (("--pdm-layers", "2", "--argmax-weight", "1", "--fill-weights", "1"),
     "--fill-weights is a PDM option"),
    (("--pdm-layers", "2", "--argmax-weight", "1"), "--argmax-weight must be >= 0"),
])
def test_eagle3_refusals_keep_their_messages(argv, message):
    with pytest.raises(SPDError) as info:
        eagle_train.TRAIN.check_options(_options("--method", "eagle3", *argv))
    assert str(info.value).startswith(message)


def test_a_refusal_names_its_values():
    r = Refusal(("a", "b"), "{method}: a={a} b={b}", given=lambda v: v is not None)
    r.check("m", _Ns(a=None, b=None))
    with pytest.raises(SPDError, match="^m: a=None b=0$"):
        r.check("m", _Ns(a=None, b=0))
    Refusal(("a",), "never").check("m", _Ns(a=0))  # default: a falsy value is not given


class _Ns:
    def __init__(self, **kw):
        self.__dict__.update(kw)
