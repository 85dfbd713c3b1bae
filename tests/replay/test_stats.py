"""The session report: totals, the key table, and input choices grouped across keys."""

from replay.stats import MAX_INPUT_CHOICES, InputChoice, Stats, report


def _choices(keys: list[str], staged_in: set[str]) -> list[InputChoice]:
    choices = []
    for key in keys:
        choices.append(InputChoice("step", key, "args[0]", "rebound"))
        if key in staged_in:
            choices.append(InputChoice("step", key, "args[1]", "staged", "a torch op reads it"))
        else:
            choices.append(InputChoice("step", key, "args[1]", "rebound"))
    return choices


def test_the_same_choice_in_every_key_is_one_line():
    keys = [f"(float32[{n}])" for n in range(1, 9)]
    text = report(Stats(inputs=_choices(keys, staged_in=set())), rows=[])
    assert "    step args[0]: rebound, in all 8 keys" in text.splitlines()
    assert "    step args[1]: rebound, in all 8 keys" in text.splitlines()
    assert len([line for line in text.splitlines() if "args[" in line]) == 2


def test_a_choice_made_in_some_keys_names_them():
    keys = [f"(float32[{n}])" for n in range(1, 6)]
    text = report(Stats(inputs=_choices(keys, staged_in={keys[1], keys[3], keys[4]})), rows=[])
    lines = text.splitlines()
    assert "    step args[1]: rebound, in 2 of 5 keys: (float32[1]), (float32[3])" in lines
    assert "    step args[1]: staged (a torch op reads it), in 3 of 5 keys: (float32[2]), (float32[4]), ..." in lines


def test_a_single_key_is_named_inline():
    text = report(Stats(inputs=_choices(["(float32[2,3])"], staged_in=set())), rows=[])
    assert "    step (float32[2,3]) args[0]: rebound" in text.splitlines()


def test_totals_and_key_table():
    stats = Stats(calls=10, replays=8, eager_runs=2, records=1, graphs=1)
    text = report(stats, rows=[("step", "(float32[2])", "recorded", 10, 8, 2, "1.20", "0.5")])
    assert "calls 10, replays 8, eager runs 2, records 1" in text
    header, rule, row = text.splitlines()[5:8]
    assert header.split() == ["region", "key", "state", "calls", "replays", "eager", "capture", "ms", "MiB"]
    assert set(rule.replace(" ", "")) == {"-"}
    assert row.split() == ["step", "(float32[2])", "recorded", "10", "8", "2", "1.20", "0.5"]


def test_a_session_keeps_the_input_choices_of_its_most_recent_recordings():
    stats = Stats()
    keys = [f"(float32[{n}])" for n in range(MAX_INPUT_CHOICES)]
    stats.inputs.extend(_choices(keys, staged_in=set()))  # two per key
    assert len(stats.inputs) == MAX_INPUT_CHOICES and stats.inputs[0].key == keys[MAX_INPUT_CHOICES // 2]
    copied = stats.copy()
    assert copied.inputs == list(stats.inputs) and copied.inputs is not stats.inputs
