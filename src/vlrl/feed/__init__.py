"""The group feed: what an RL loop trains on, as scored groups, and the only place that publishes weights to the rollout.

The loop (`vlrl.train.loop.rl_loop`) coordinates three values — this feed, a learner (`vlrl.train.learner`) and the
runtime — as slime's ``train.py`` / ``train_async.py`` do; synchronous and asynchronous RL differ only inside the feed
(slime: only in when the rollout is awaited):

    start(step, weights)        the rollout starts from the trainer's weights (async: loads them, starts its workers)
    next_batch(step)            a step's scored groups (`FeedBatch`): generation, scoring, the DAPO filter (slime's
                                producer-side filter), staleness — sync generates them now, async takes them from
                                its buffer
    publish(version, weights)   the new weights reach the engine (AReaL: pause → update → set version → resume)
    aside()                     held around an evaluation within the run (``eval.every``): async waits for the
                                step's weights to reach the engine and pauses its admissions
    finish_step(batch, step, shaping)   Syn-GRPO's descriptions and swaps, the feed's ``sampling/…``,
                                ``staleness/…`` and timing metrics of the step
    state() / load_state(...)   what a checkpoint carries (`vlrl.feed.records`)
    close(drained)              stop the workers, the synthesis client; after a whole run, wait for the servers to
                                hold the final weights

`SyncFeed` (`vlrl.feed.sync`) and `AsyncFeed` (`vlrl.feed.asynchronous`) are built by `vlrl.feed.build.build_feed`
from the stage's ``rollout.mode``; the records they exchange are `vlrl.feed.types`'. A feed logs through a small `FeedLogger` (``info``, ``warn``) and runs on the trainer's ranks
through `Ranks` (`vlrl.train.distributed.DistContext` is one): it imports neither the report nor the training room.
"""
