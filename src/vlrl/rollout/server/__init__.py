"""vlrl's reference rollout server (`vlrl serve`): any transformers policy behind SGLang's native HTTP API.

The server speaks the subset of SGLang's native API that RL training needs, so a real SGLang server can take
its place on GPUs (see the README, "Rollout servers and asynchronous RL"):

- ``POST /generate``: one prompt as ``input_ids`` or ``text``; ``image_data`` (base64, data URL or path; one
  or a list); ``sampling_params`` with SGLang's names (``n``, ``temperature``, ``top_p``, ``top_k``,
  ``max_new_tokens``, ``stop``, ``stop_token_ids``, ``logit_bias``); ``return_logprob``; types as strict as SGLang's
  schema, and a batch's ``image_data`` in its forms (`prompt_image_items`). The answer has SGLang's shape: ``text``, ``output_ids``
  and ``meta_info`` with ``finish_reason`` (``{"type": "stop" | "length" | "abort", ...}``),
  ``output_token_logprobs`` (``[[logprob, token_id, null], ...]``, log-softmax of logits / temperature,
  as SGLang returns by default), ``prompt_tokens``, ``completion_tokens`` and ``weight_version`` (and, with
  ``return_prompt_token_ids``, the ``prompt_token_ids`` it sampled from); a list of
  ``n`` such objects when ``n > 1``. A batch (``text`` / ``input_ids`` a list of B prompts, ``image_data``
  and ``rid`` then one item per prompt) is decoded as one batch and answered as a list of B × n objects,
  prompt-major (SGLang's order).
- ``POST /update_weights_from_disk``: ``model_path`` (a transformers directory), ``weight_version``,
  ``abort_all_requests``; answers ``success``, ``message``, and (vlrl extensions) the new
  ``weight_version`` and a ``weight_checksum`` of the loaded weights that the trainer compares with its own.
  Safetensors weights are copied in place into a spare copy of the model (`vlrl.rollout.weights`); other
  formats are loaded with ``from_pretrained``.
- ``POST /init_weights_update_group`` (``master_address``, ``master_port``, ``rank_offset``, ``world_size``,
  ``group_name``, ``backend``) and ``POST /update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``,
  ``group_name``, ``weight_version``, ...): SGLang's distributed weight sync (`vlrl.rollout.dist_sync`). The
  server joins the trainer's group over gloo (on CPU) in a thread off the event loop (not holding the update lock,
  so a join that never completes cannot hold up a disk load), receives each bucket's broadcast straight into its
  spare weights (their tensors become views of the bucket's storage; a bucket in another dtype is received into a
  buffer and cast in); the bucket carrying ``weight_version`` completes the update, which is swapped in like a
  disk load and answered with its ``weight_checksum``. A disk load or a new group drops an update left half-way.
  ``POST /destroy_weights_update_group`` leaves a group; joins run one at a time on a daemon thread of their own,
  bounded by ``join_timeout`` (`WeightRoutes`).
- ``POST /begin_weight_update`` / ``POST /end_weight_update``: SGLang 0.5.23's weight-update session — a distributed
  update outside it is refused with SGLang's message, one session at a time; ``POST /flush_cache`` answers as SGLang's
  (vlrl serve keeps no cache across requests).
- ``POST /pause_generation`` (``mode``: ``abort``, ``retract``, ``in_place``) and ``POST /continue_generation``
  (`ContinuousBatcher.pause`); with ``--admin-api-key`` these and the weight routes take that key only.
- ``GET /health``, ``GET /server_info`` (SGLang's parallel sizes and batch bound, then vlrl's facts),
  ``GET /get_model_info``, ``GET /get_weight_version``.

Batching: one worker thread decodes; requests that arrive while a batch decodes join the next batch
(`vlrl.rollout.batcher.ContinuousBatcher`). A weight load never waits for a batch: the new weights are loaded beside the old ones
and swapped in at the next batch boundary, so a batch that was decoding finishes on the old weights and is
tagged with the old version. With ``abort_all_requests`` the queued requests and the decoding batch are
answered with ``finish_reason.type == "abort"`` instead (the client re-queues them).

Safety: binds to loopback and requires ``Authorization: Bearer <key>`` (except ``/health``) by default. Every
request is bounded before it is admitted (`ServeLimits`: ``max_new_tokens``, prompt + new tokens ≤ the model's
context, body bytes counted as received, image pixels and vision tokens read from headers; the batcher: samples
= prompts × n against the queue, tokens in flight; the pixels of all of a request's images; the body's read time
and the bytes of all requests held at once) — a 400 naming the field, 413 for the body, 408 / 503 while full.
JSON is parsed off the event loop (`vlrl.serving.BodyParser`), image decoding runs on an image thread and tokenizing
on one preprocessing thread, so ``/health`` answers under any load. A client that disconnects, or a request past its
deadline, stops at the next decode step. Unexpected errors answer 500 with an id (the traceback goes to the
log); server paths in ``image_data`` are read only under configured roots. SIGTERM drains within a bound.

The modules: `schema` (the request bodies and `ServeLimits`), `prompts` (body → requests, trajectory → answer),
`weight_routes` (the weight and pause routes), `app` (`create_app`, `serve`). The batcher
(`vlrl.rollout.batcher`) is shared with the in-process asynchronous engine (`vlrl.rollout.threaded_engine`).
"""

from vlrl.rollout.server.app import ADMIN_PATHS, create_app, serve
from vlrl.rollout.server.schema import ServeLimits

__all__ = ["ADMIN_PATHS", "ServeLimits", "create_app", "serve"]
