"""The dataset layouts other frameworks write, and how a row of one becomes a `Sample`.

vlrl's own layout is the `Sample` jsonl/parquet form (`vlrl.data.sample`). Beside it, the layouts users bring
(README "Train on your own data"):

- ``easyr1`` — EasyR1's ``RLHFDataset`` (``verl/utils/dataset.py``; e.g. ``hiyouga/geometry3k``): ``problem``
  (text with ``<image>`` markers), ``answer``, ``images`` (a list of HF ``Image`` values ``{"bytes", "path"}``).
  The prompt string is wrapped by a jinja ``format_prompt`` rendered with ``content=<problem>``, then split at
  ``<image>`` into text and image parts of one user message; the verifier is the run's (EasyR1's examples: math).
- ``verl`` — what ``examples/data_preprocess/geo3k.py`` writes for verl's ``RLHFDataset``
  (``verl/utils/dataset/rl_dataset.py``): ``data_source``, ``prompt`` (a chat list whose string contents hold
  ``<image>``), ``images``, ``ability``, ``reward_model: {style, ground_truth}``, ``extra_info``; the verifier is
  chosen by ``data_source`` (verl's ``default_compute_score``; here ``data.reward_by_source``).
- ``trl`` — TRL's GRPO datasets (e.g. ``lmms-lab/multimodal-open-r1-8k-verified``): ``image`` or ``images``,
  ``problem`` or ``prompt`` (a string, or conversational messages whose parts may hold ``{"type": "image"}``),
  ``solution``; every other column reaches the reward function as a keyword argument. As TRL's
  ``prepare_multimodal_messages``: a prompt without image parts gets its images before the first user text.

One converter serves the three (`row_to_sample`); a `Layout` names each one's columns, `data.columns` renames
them for any other dataset. Columns a layout does not use go to ``Sample.metadata`` (the verifier's keyword
arguments), as TRL passes them.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from PIL import Image

from vlrl.data.sample import IMAGE_MARKER, DeferredImage, Sample, SampleError, sample_from_json

FORMATS = ("auto", "vlrl", "easyr1", "verl", "trl")
COLUMN_FIELDS = ("id", "task", "prompt", "images", "answer", "response", "reward")
"""The fields `data.columns` maps to a dataset's columns."""
VLRL_FIELDS = frozenset({"id", "task", "messages", "prompt", "images", "videos", "answer", "reward", "response",
                         "metadata"})
_DATA_URL = re.compile(r"^data:image/[a-zA-Z0-9.+-]+;base64,")

# verl's `default_compute_score` dispatch, as far as a vlrl verifier scores the same thing: these sources put the
# answer in \boxed{} (geo3k.py's instruction, the MATH sets), which the `math` verifier reads. gsm8k ("#### 42") is
# not here: its answer form is not one vlrl's verifiers extract — map it yourself (data.reward_by_source).
VERL_SOURCES: dict[str, str] = {
    "hiyouga/geometry3k": "math", "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math", "math_dapo": "math", "math": "math",
}


@dataclass(frozen=True)
class Schema:
    """How the rows of a dataset become samples (the ``data.*`` fields of the same names).

    Attributes:
        format: ``auto`` (detected from the columns, see `detect_format`), ``vlrl``, ``easyr1``, ``verl``, ``trl``.
        columns: vlrl field (`COLUMN_FIELDS`) → the dataset's column, over the layout's own names.
        prompt_template: jinja text rendered with ``content`` = the prompt text (``<image>`` markers in place)
            and every other column by name — EasyR1's ``format_prompt``; None: the prompt as it is. Rendered in
            jinja's immutable sandbox (`compile_template`): a template is untrusted input.
        template_file: the file ``prompt_template`` was read from (named in its errors), if any.
        system_prompt: a system message put first (unless the prompt has one).
        reward: the verifier of rows that name none (a name, or weights of several).
        reward_by_source: task / ``data_source`` → verifier, before ``reward`` (verl's dispatch by data_source).
        split / subset / revision: of a hub id or a ``save_to_disk`` folder (``datasets.load_dataset(id,
            name=subset, split=split, revision=revision)``); ``PATH@split`` in the path wins over ``split``.
    """

    format: str = "auto"
    columns: Mapping[str, str] = field(default_factory=dict)
    prompt_template: str | None = None
    template_file: str | None = None
    system_prompt: str | None = None
    reward: str | Mapping[str, float] | None = None
    reward_by_source: Mapping[str, str | Mapping[str, float]] = field(default_factory=dict)
    split: str = "train"
    subset: str | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"data.format: {self.format!r} is not one of {', '.join(FORMATS)}")
        unknown = sorted(set(self.columns) - set(COLUMN_FIELDS))
        if unknown:
            raise ValueError(f"data.columns: unknown field(s) {unknown}; map any of {', '.join(COLUMN_FIELDS)}")
        if self.prompt_template is not None:
            compile_template(self.prompt_template, self.template_file)  # a syntax error names the field before any row is read


@dataclass(frozen=True)
class Layout:
    """The columns of one framework's layout: candidates in order, the first present wins (a dotted name reads
    inside a struct column: ``reward_model.ground_truth``)."""

    prompt: tuple[str, ...]
    answer: tuple[str, ...]
    images: tuple[str, ...] = ("images",)
    response: tuple[str, ...] = ()
    task: tuple[str, ...] = ()
    id: tuple[str, ...] = ("id",)
    reward: tuple[str, ...] = ()
    default_reward: str | None = None  # the framework's own default verifier, when the run names none
    why_default: str = ""


LAYOUTS: dict[str, Layout] = {
    "easyr1": Layout(prompt=("problem",), answer=("answer",), default_reward="math",
                     why_default="EasyR1's example reward (examples/reward_function/math.py)"),
    "verl": Layout(prompt=("prompt",), answer=("reward_model.ground_truth",), task=("data_source",)),
    "trl": Layout(prompt=("prompt", "problem"), answer=("solution",), images=("images", "image"),
                  response=("completion",), default_reward="math",
                  why_default="the accuracy reward of TRL's VLM example (trl.rewards.accuracy_reward, math-verify)"),
    # a dataset of no known layout, all of whose columns come from data.columns
    "columns": Layout(prompt=(), answer=()),
}


# ----------------------------------------------------------------------------------------------- detection
def detect_format(columns: list[str], schema: Schema) -> tuple[str, str]:
    """(format, why) for a dataset with these columns: ``schema.format`` when it is not ``auto``, else the layout
    whose columns are present. `SampleError` names the columns when none fits."""
    cols = set(columns)
    if schema.format != "auto":
        return schema.format, "data.format"
    listed = ", ".join(sorted(cols))
    if "id" in cols and cols <= VLRL_FIELDS and {"messages", "prompt"} & cols:
        return "vlrl", f"auto: vlrl's own fields ({listed})"
    if {"prompt", "reward_model"} <= cols:
        return "verl", "auto: prompt + reward_model, verl's RLHFDataset layout (examples/data_preprocess)"
    if "solution" in cols and {"prompt", "problem"} & cols:
        return "trl", f"auto: {'prompt' if 'prompt' in cols else 'problem'} + solution, TRL's GRPO layout"
    if {"problem", "answer"} <= cols:
        return "easyr1", "auto: problem + answer, EasyR1's layout (data.prompt_key / answer_key defaults)"
    if {"prompt", "answer"} <= set(schema.columns):
        return "columns", "auto: no known layout; data.columns names the prompt and the answer"
    raise SampleError(
        f"cannot tell the layout of a dataset with columns [{listed}]: set data.format (vlrl, easyr1, verl, trl) "
        "and/or data.columns (e.g. {prompt: question, answer: label, images: image})")


# ----------------------------------------------------------------------------------------------- rows → samples
@dataclass(frozen=True)
class RowContext:
    """Where a row comes from: the default task and id prefix of its table, the directory relative image paths
    resolve against, and the detected format."""

    name: str
    id_prefix: str
    base_dir: Path
    format: str


def row_to_sample(row: Mapping[str, Any], index: int, schema: Schema, ctx: RowContext) -> Sample:
    """One dataset row as a validated `Sample` (`SampleError` names the field or column)."""
    if ctx.format == "vlrl":
        return _vlrl_sample(row, schema, ctx)
    layout = LAYOUTS[ctx.format]
    used: set[str] = set()

    def column(fieldname: str, candidates: tuple[str, ...]) -> tuple[str | None, Any]:
        names = (schema.columns[fieldname],) if fieldname in schema.columns else candidates
        for name in names:
            head = name.split(".", 1)[0]
            if head in row:
                used.add(head)
                return name, _dig(row, name)
        if fieldname in schema.columns:
            raise SampleError(f"data.columns.{fieldname}: no column {schema.columns[fieldname]!r} in this row "
                              f"(columns: {', '.join(sorted(row))})")
        return None, None

    prompt_name, prompt = column("prompt", layout.prompt)
    if prompt_name is None:
        raise SampleError(f"no prompt column ({' or '.join(layout.prompt) or 'data.columns.prompt'}); columns: "
                          f"{', '.join(sorted(row))}")
    answer_name, answer = column("answer", layout.answer)
    if answer_name is None:
        raise SampleError(f"no answer column ({' or '.join(layout.answer) or 'data.columns.answer'})")
    if answer is None or answer == "":
        raise SampleError(f"column {answer_name!r}: empty (the verifier needs the ground truth)")
    if ctx.format == "trl" and isinstance(answer, str):
        answer = _solution_answer(answer)
    _, images = column("images", layout.images)
    images = _image_list(images, ctx.base_dir)
    _, response = column("response", layout.response)
    _, task = column("task", layout.task)
    _, sample_id = column("id", layout.id)
    _, row_reward = column("reward", layout.reward or ("reward",))
    task = str(task) if task not in (None, "") else ctx.name
    metadata = {k: v for k, v in row.items() if k not in used and _plain(v)}
    messages = build_messages(prompt, len(images), schema=schema, variables={**metadata, **_scalars(row, used)})
    sample = Sample(
        id=str(sample_id) if sample_id not in (None, "") else f"{ctx.id_prefix}-{index}",
        task=task,
        messages=messages,
        images=images,
        answer=answer,
        reward=choose_reward(row_reward, task, schema, layout),
        response=_response_text(response),
        metadata=metadata,
    )
    sample.validate()
    return sample


def _vlrl_sample(row: Mapping[str, Any], schema: Schema, ctx: RowContext) -> Sample:
    """vlrl's own record, with the run's defaults (verifier, system prompt, template) where the record has none."""
    record = dict(row)
    if not record.get("reward"):
        reward = choose_reward(None, str(record.get("task") or ""), schema, None)
        if reward:
            record["reward"] = reward
    if record.get("images"):  # paths stay as written: `sample_from_json` resolves them against base_dir (once)
        record["images"] = [v if isinstance(v, str) else image_source(v, ctx.base_dir, f"images[{k}]")
                            for k, v in enumerate(_as_list(record["images"]))]
    sample = sample_from_json(record, ctx.base_dir)
    if schema.prompt_template is not None or schema.system_prompt is not None:
        sample = replace(sample, messages=build_messages(sample.messages, len(sample.images), schema=schema,
                                                         variables={"id": sample.id, "task": sample.task,
                                                                    **sample.metadata}))
        sample.validate()
    return sample


def choose_reward(row_reward: Any, task: str, schema: Schema, layout: Layout | None) -> str | dict[str, float]:
    """The row's own ``reward`` (a verifier name or weights) wins; then ``data.reward_by_source`` for the row's
    task / data_source; then ``data.reward``; then the layout's framework default; else "" (the sample is then
    refused, naming the field)."""
    if isinstance(row_reward, str) and row_reward:
        return row_reward
    if isinstance(row_reward, Mapping) and row_reward and all(isinstance(v, (int, float)) for v in row_reward.values()):
        return dict(row_reward)
    if task in schema.reward_by_source:
        found = schema.reward_by_source[task]
        return dict(found) if isinstance(found, Mapping) else found
    if schema.reward:
        return dict(schema.reward) if isinstance(schema.reward, Mapping) else schema.reward
    if layout is not None and layout is LAYOUTS["verl"] and task in VERL_SOURCES:
        return VERL_SOURCES[task]
    if layout is not None and layout.default_reward:
        return layout.default_reward
    return ""


def default_reward_note(fmt: str, schema: Schema) -> str | None:
    """What the log says about the verifier when the run names none."""
    if schema.reward or fmt not in LAYOUTS:
        return None
    layout = LAYOUTS[fmt]
    if fmt == "verl":
        return ("verifier by data_source (data.reward_by_source, else verl's dispatch: "
                + ", ".join(f"{k} → {v}" for k, v in VERL_SOURCES.items() if "/" in k) + ")")
    if layout.default_reward:
        return f"verifier {layout.default_reward} ({layout.why_default}; set data.reward to choose another)"
    return None


def _dig(row: Mapping[str, Any], name: str) -> Any:
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise SampleError(f"column {name!r}: no {part!r} in {type(value).__name__}")
        value = value[part]
    return value


def _solution_answer(solution: str) -> str:
    """TRL's ``solution`` may hold the answer inside ``<answer>`` tags or ``\\boxed{}`` (its accuracy reward
    parses it with math-verify); the verifier gets that final answer."""
    from vlrl.rewards.extract import final_answer

    return final_answer(solution) or solution


def _response_text(response: Any) -> str | None:
    """A reference response: a string, or TRL's conversational completion (assistant messages)."""
    if response is None or isinstance(response, str):
        return response
    if isinstance(response, list):
        texts = []
        for message in response:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.append("".join(p.get("text", "") for p in content if isinstance(p, Mapping)))
        return "".join(texts)
    raise SampleError(f"column 'response': expected text or assistant messages, got {type(response).__name__}")


def _plain(value: Any) -> bool:
    """Whether a column's value can travel as verifier metadata (JSON: no image bytes, no PIL images)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (bytes, Image.Image, DeferredImage)):
        return False
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False


def _scalars(row: Mapping[str, Any], used: set[str]) -> dict[str, Any]:
    """The row's used columns that a template may name too (``{{ problem }}``)."""
    return {k: v for k, v in row.items() if k in used and _plain(v)}


# ----------------------------------------------------------------------------------------------- images
def _image_list(value: Any, base_dir: Path) -> list[Any]:
    """A row's images as vlrl image sources: one value or a list; HF ``Image`` values (``{"bytes", "path"}``),
    PIL images, encoded bytes, data URLs, paths (relative ones from ``base_dir``), lazy Arrow rows."""
    return [image_source(v, base_dir, f"images[{k}]") for k, v in enumerate(_as_list(value))]


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def image_source(value: Any, base_dir: Path, name: str = "image") -> Any:
    """One image value of a dataset as a vlrl image source (`vlrl.data.sample.ImageSource`)."""
    if isinstance(value, (Image.Image, bytes, DeferredImage)):
        return value
    if isinstance(value, Mapping):  # the HF `datasets` Image feature, undecoded: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, str) and value:
        if _DATA_URL.match(value):
            return value
        return value if Path(value).is_absolute() else str(base_dir / value)
    raise SampleError(f"field '{name}': expected an image (HF Image {{bytes, path}}, bytes, a path or a data URL), "
                      f"got {type(value).__name__}")


# ----------------------------------------------------------------------------------------------- prompts
class TemplateRefused(RuntimeError):
    """A prompt template that reached for something templates may not (jinja's sandbox refused it): the template's
    fault, not a row's — `vlrl.data.read_samples` stops on it whatever ``on_error`` says."""


def _template_field(file: str | None) -> str:
    return f"data.prompt_template ({file})" if file else "data.prompt_template"


@lru_cache(maxsize=16)
def compile_template(text: str, file: str | None = None):
    """A jinja template in an immutable sandbox (transformers renders chat templates the same way: a template
    comes with a dataset or a shared recipe, so it is untrusted input): no attribute starting with ``_``, no
    method that changes a list or dict, no ``str.format`` escape. Undefined names are errors, as a typo in a
    column name should be. ``file``: where the text came from (named in errors)."""
    from jinja2 import StrictUndefined, TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        return ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True).from_string(
            text.strip())
    except TemplateSyntaxError as err:
        raise ValueError(f"{_template_field(file)}: line {err.lineno}: {err.message}") from None


def render_template(text: str, content: str, variables: Mapping[str, Any], file: str | None = None) -> str:
    """EasyR1's ``format_prompt``: ``Template(text.strip()).render(content=prompt)`` — here with the row's other
    columns as variables too (``content`` wins a clash), in jinja's immutable sandbox: a template reaching for an
    attribute or method it may not raises `TemplateRefused` (one line naming the file)."""
    from jinja2 import UndefinedError
    from jinja2.exceptions import SecurityError

    try:
        return compile_template(text, file).render({**variables, "content": content})
    except SecurityError as err:
        raise TemplateRefused(f"{_template_field(file)}: refused by the template sandbox: {err}") from None
    except UndefinedError as err:
        raise SampleError(f"{_template_field(file)}: {err.message} (variables: content, "
                          f"{', '.join(sorted(variables))})") from None


def build_messages(prompt: Any, n_images: int, *, schema: Schema, variables: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Chat messages with image parts from a prompt string or message list.

    String contents are split at ``<image>`` markers (EasyR1, verl); a prompt with no image part at all gets its
    ``n_images`` image parts before the first user text (TRL's ``prepare_multimodal_messages``). The template
    renders the last user message (its image parts as ``<image>``); the system prompt goes first unless one is
    there."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        messages = [dict(m) for m in copy.deepcopy(prompt)]
    else:
        raise SampleError(f"field 'prompt': expected text or chat messages ({{role, content}}), got "
                          f"{type(prompt).__name__}")
    if schema.prompt_template is not None:
        users = [k for k, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise SampleError("field 'prompt': no user message for data.prompt_template to render")
        last = messages[users[-1]]
        last["content"] = render_template(schema.prompt_template, _as_text(last.get("content")), variables,
                                          schema.template_file)
    messages = [{**m, "content": _parts(m.get("content"))} for m in messages]
    if n_images and not any(p["type"] == "image" for m in messages for p in m["content"]):
        for m in messages:
            if m.get("role") == "user":
                m["content"] = [{"type": "image"} for _ in range(n_images)] + m["content"]
                break
    if schema.system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": schema.system_prompt})
    return messages


def _as_text(content: Any) -> str:
    """A message content as text with ``<image>`` markers (for the template)."""
    if isinstance(content, str):
        return content
    out = []
    for part in content or []:
        kind = part.get("type") if isinstance(part, Mapping) else None
        out.append(IMAGE_MARKER if kind == "image" else (part.get("text") or "") if kind == "text" else "")
    return "".join(out)


def _parts(content: Any) -> list[dict[str, Any]]:
    """Content parts: text split at ``<image>`` markers; given parts normalised to ``{"type": "text", "text"}`` /
    ``{"type": "image"}`` (an inline payload, e.g. TRL's ``{"type": "image", "image": ...}``, is dropped: the
    row's image column holds the images)."""
    if content is None:
        return []
    if isinstance(content, str):
        parts: list[dict[str, Any]] = []
        for k, chunk in enumerate(content.split(IMAGE_MARKER)):
            if k:
                parts.append({"type": "image"})
            if chunk:
                parts.append({"type": "text", "text": chunk})
        return parts
    if not isinstance(content, list):
        raise SampleError(f"field 'prompt': a message content must be text or a list of parts, got {type(content).__name__}")
    out: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "image":
            out.append({"type": "image"})
        elif kind == "text":
            out.extend(_parts(part.get("text") or ""))
        elif isinstance(part, str):
            out.extend(_parts(part))
        else:
            raise SampleError(f"field 'prompt': a content part of type {kind!r} (expected text or image)")
    return out
