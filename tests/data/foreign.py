"""Small datasets in the layouts EasyR1, verl and TRL write, built from real images that ship with scikit-image.

Each builder follows the project's own code (read 2026-11-28):

- EasyR1 — ``hiyouga/geometry3k`` as EasyR1's ``RLHFDataset`` reads it (hiyouga/EasyR1 ``verl/utils/dataset.py``:
  ``prompt_key: problem``, ``answer_key: answer``, ``image_key: images``; ``examples/config.yaml``): ``images`` is a
  list of HF ``Image`` values (stored as ``{"bytes", "path"}``), ``problem`` holds ``<image>`` where each image goes.
- verl — the output of volcengine/verl ``examples/data_preprocess/geo3k.py``: its ``process_fn`` pops problem /
  answer / images from each geometry3k row and returns ``data_source``, ``prompt`` (``[{"role": "user", "content":
  problem + " " + instruction}]``), ``images``, ``ability: "math"``, ``reward_model: {style: "rule", ground_truth:
  answer}``, ``extra_info: {split, index, answer, question}``, applied with ``Dataset.map(..., with_indices=True)``
  and written with ``to_parquet``.
- TRL — ``lmms-lab/multimodal-open-r1-8k-verified`` after huggingface/trl ``examples/scripts/grpo_vlm.py``'s
  ``make_conversation`` (``prompt = [system, user(problem)]`` added by ``map``; ``image``, ``problem``, ``solution``,
  ``original_question``, ``original_answer`` kept), plus a prompt-completion variant (``completion``: assistant
  messages) for SFT, as TRL's conversational prompt-completion format.

Every answer is ``7`` (a warm start SFT'd on "\\boxed{7}" then scores 1 exactly when the verifier receives the
mapped answer column); the images are scikit-image's own, shrunk to at most 56 px a side (few vision tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

ANSWER = "7"
INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
               r"The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \boxed{}.")
SYSTEM = ("A conversation between user and assistant. The user asks a question, and the assistant solves it. The "
          "assistant first thinks about the reasoning process in the mind and then provides the user with the answer.")
_NAMES = ("astronaut", "coffee", "chelsea", "rocket", "camera", "coins", "text", "page", "moon", "horse")


def images(n: int, side: int = 56) -> list[Image.Image]:
    """``n`` real photographs from scikit-image's data module (grey ones kept grey), thumbnailed to ``side``."""
    import skimage.data

    out = []
    for k in range(n):
        array = getattr(skimage.data, _NAMES[k % len(_NAMES)])()
        image = Image.fromarray(np.asarray(array if array.dtype == np.uint8 else (array * 255).astype(np.uint8)))
        image.thumbnail((side, side))
        out.append(image)
    return out


def geometry3k(n: int, *, offset: int = 0):
    """EasyR1's layout (hiyouga/geometry3k): images (list of Image), problem with <image>, answer."""
    import datasets

    features = datasets.Features({"images": datasets.List(datasets.Image()), "problem": datasets.Value("string"),
                                  "answer": datasets.Value("string")})
    pictures = images(n + offset)[offset:]
    rows = {"images": [[p] for p in pictures],
            "problem": [f"<image>Find x in the figure {k}. Use the measures shown." for k in range(offset, offset + n)],
            "answer": [ANSWER] * n}
    return datasets.Dataset.from_dict(rows, features=features)


def verl_geo3k(raw, split: str):
    """volcengine/verl examples/data_preprocess/geo3k.py's ``make_map_fn(split)`` applied to ``raw``."""
    data_source = "hiyouga/geometry3k"

    def process_fn(example, idx):
        problem = example.pop("problem")
        prompt = problem + " " + INSTRUCTION
        answer = example.pop("answer")
        images_ = example.pop("images")
        return {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": prompt}],
            "images": images_,
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": idx, "answer": answer, "question": problem},
        }

    return raw.map(function=process_fn, with_indices=True)


def open_r1(n: int, *, offset: int = 0, completion: bool = False):
    """TRL's layout (multimodal-open-r1-8k-verified after grpo_vlm.py's make_conversation): image, problem,
    solution, original_question, original_answer, prompt = [system, user(problem)]; with ``completion`` also
    the assistant's reference turn (TRL's conversational prompt-completion format)."""
    import datasets

    pictures = images(n + offset)[offset:]
    rows = {"image": pictures,
            "problem": [f"What is the value of x in picture {k}?" for k in range(offset, offset + n)],
            "solution": [f"<answer>{ANSWER}</answer>"] * n,
            "original_question": [f"picture {k}: solve for x" for k in range(offset, offset + n)],
            "original_answer": [ANSWER] * n}
    dataset = datasets.Dataset.from_dict(rows, features=datasets.Features({
        "image": datasets.Image(), "problem": datasets.Value("string"), "solution": datasets.Value("string"),
        "original_question": datasets.Value("string"), "original_answer": datasets.Value("string")}))

    def make_conversation(example):
        out = {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example["problem"]}]}
        if completion:
            out["completion"] = [{"role": "assistant", "content": rf"\boxed{{{ANSWER}}}"}]
        return out

    return dataset.map(make_conversation)


def write_all(root: Path, *, n_train: int = 8, n_test: int = 2) -> dict[str, Path | str]:
    """The fixtures on disk, each as its project stores it:

    - ``easyr1``: a ``DatasetDict(train, test).save_to_disk`` folder (read with ``@split`` / data.split);
    - ``verl``: ``train.parquet`` + ``test.parquet`` as geo3k.py writes them;
    - ``trl``: ``train.arrow`` + ``test.arrow`` (a dataset's Arrow stream file, as `save_to_disk` writes it);
    - ``trl_sft``: the prompt-completion variant, ``train.parquet`` + ``test.parquet``."""
    import shutil

    import datasets

    root.mkdir(parents=True, exist_ok=True)
    train, test = geometry3k(n_train), geometry3k(n_test, offset=n_train)
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(root / "easyr1"))
    (root / "verl").mkdir(exist_ok=True)
    verl_geo3k(train, "train").to_parquet(str(root / "verl" / "train.parquet"))
    verl_geo3k(test, "test").to_parquet(str(root / "verl" / "test.parquet"))
    (root / "trl").mkdir(exist_ok=True)
    for split, data in (("train", open_r1(n_train)), ("test", open_r1(n_test, offset=n_train))):
        saved = root / f"trl_{split}_saved"
        data.save_to_disk(str(saved))
        shutil.copy(next(saved.glob("*.arrow")), root / "trl" / f"{split}.arrow")
        shutil.rmtree(saved)
    (root / "trl_sft").mkdir(exist_ok=True)
    open_r1(n_train, completion=True).to_parquet(str(root / "trl_sft" / "train.parquet"))
    open_r1(n_test, offset=n_train, completion=True).to_parquet(str(root / "trl_sft" / "test.parquet"))
    return {"easyr1": root / "easyr1", "verl": root / "verl", "trl": root / "trl", "trl_sft": root / "trl_sft"}
