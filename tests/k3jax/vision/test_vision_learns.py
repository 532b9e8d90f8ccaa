"""experiments/vision_learns.py: the data is what the docstring says (fast), and the CPU run learns to see (slow)."""

import dataclasses
import json

import numpy as np
import pytest

from experiments import vision_learns as vl


def test_data_and_report_are_well_formed(tmp_path):
    s = vl.PRESETS["smoke"]
    cfg = vl.make_cfg(s)
    samples = vl.renders(s, 16, 0)
    tokens, mask, answer_at, is_count, media = vl.dataset(cfg, samples, with_images=True)
    text = vl.dataset(cfg, samples, with_images=False)
    merged = (s.image // 28) ** 2
    assert (tokens == vl.MEDIA_ID).sum(1).tolist() == [merged] * 16 and int(media.merged_valid.sum()) == 16 * merged
    assert not (text[0] == vl.MEDIA_ID).any() and text[4] is None
    # Same questions and answers with and without the image; the answer is the last prompt byte.
    answers = tokens[np.arange(16), answer_at + 1]
    np.testing.assert_array_equal(answers, text[0][np.arange(16), text[2] + 1])
    assert set(map(chr, answers[is_count])) <= set("1234") and set(map(chr, answers[~is_count])) <= set("rgby")
    assert not mask[tokens == vl.MEDIA_ID].any() and mask[np.arange(16), answer_at].all()
    fake = {"losses": [2.0, 1.0], "train_seconds": 1.0, "accuracy_colour": 0.5, "accuracy_count": 0.5, "accuracy": 0.5}
    vl.write({"settings": dataclasses.asdict(s), "chance": 0.25, "vision": fake, "text_only": fake}, tmp_path)
    assert json.loads((tmp_path / "vision_learns.json").read_text())["chance"] == 0.25
    assert (tmp_path / "vision_learns.png").stat().st_size > 0


@pytest.mark.slow
def test_cpu_run_sees_the_image(tmp_path):
    result = vl.run(vl.PRESETS["cpu"], tmp_path, log=lambda *_: None)
    v, t = result["vision"], result["text_only"]
    assert t["accuracy_colour"] < 0.45 and t["accuracy_count"] < 0.45  # the prior: about 1/4
    assert v["accuracy_colour"] > 0.8  # colour is read off the image
    assert v["accuracy"] > t["accuracy"] + 0.25
