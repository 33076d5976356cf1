"""Weight publication: the feed is the only caller of an engine's weight update. Three ways, one per situation:

    update_in_place      the synchronous feed: ``engine.update_weights(version)`` — an in-process engine shares the
                         trainer's model (it adopts the version), rollout servers are sent the trainer's weights
    update_over_ranks    several trainer ranks: servers shared by the ranks take a collective update (rank 0 talks to
                         them); a private in-process copy (rank 0's) loads the full weights, gathered from FSDP2 shards
    publish_in_background  one process, asynchronous: a `WeightPublisher` (rollout servers) saves the weights now and
                         the servers load them while the trainer goes on; the rollout moves to the new version (its
                         admission limit with it) when every server confirmed — AReaL's pause → update → set version →
                         resume, with the last three overlapped
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from vlrl.feed.types import Ranks, Weights
from vlrl.rollout.types import Engine, WeightPublisher, capability


def update_in_place(engine: Engine, version: int) -> None:
    """The engine samples from the trainer's current weights, as ``version``, from now on."""
    engine.update_weights(version=version)


def update_over_ranks(engine: Engine, weights: Weights, version: int, ranks: Ranks) -> None:
    """A weight update under several ranks, called by every rank. Rollout servers (`HTTPEngine` after
    `join_trainer_ranks`): a collective update — rank 0 talks to the servers, every rank joins the FSDP2 gathers,
    and every rank returns once the servers confirmed (or raises rank 0's error). The in-process engine (rank 0's
    private copy): the full weights (``weights()``, a collective) loaded by rank 0."""
    servers = capability(engine, WeightPublisher)
    if servers is not None and servers.world_size > 1:  # an `HTTPEngine` shared by the trainer ranks
        engine.update_weights(version=version)
        return
    state = weights()
    if ranks.is_main:
        engine.update_weights(version=version, state_dict=state)


def publish_in_background(engine: Engine, rollout: Any, version: int,
                          state_dict: dict[str, Any]) -> concurrent.futures.Future:
    """Update the engine's weights to ``version``, then set the rollout's version and resume it. A `WeightPublisher`
    (`HTTPEngine`) saves the weights now and has the servers load them in the background: the trainer starts its next
    step meanwhile, and the rollout moves to ``version`` only when every server confirmed. Nothing is mis-tagged by
    the overlap: a token carries the version its server reports having sampled it with, and staleness is counted from
    the trainer's own version. Other engines load at once. Returns a future of the update (its error stops the run),
    done once the rollout adopted ``version`` too."""
    publisher = capability(engine, WeightPublisher)
    if publisher is None:
        engine.update_weights(version=version, state_dict=state_dict)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(version)
    else:
        done = publisher.publish(version=version, state_dict=state_dict)

    adopted: concurrent.futures.Future = concurrent.futures.Future()

    def adopt(update: concurrent.futures.Future) -> None:
        if update.cancelled() or update.exception() is not None:
            adopted.set_exception(update.exception() if not update.cancelled()
                                  else concurrent.futures.CancelledError())
            return
        rollout.set_version(version)
        rollout.resume()
        adopted.set_result(version)

    done.add_done_callback(adopt)
    return adopted
