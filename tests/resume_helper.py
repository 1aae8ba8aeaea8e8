"""A fit interrupted between chunks and resumed from its checkpoint (shared by the tests of several
families): what the resumed fit returns, to compare bit for bit with the uninterrupted one."""

from __future__ import annotations

import pytest

import fedbayes as fb


def interrupted_and_resumed(model, data, algorithm, path, at: int, **kw):
    """``fb.fed_fit(model, data, algorithm, **kw)`` stopped by a KeyboardInterrupt after round ``at`` (its
    checkpoint written there), then ``fb.resume``d to the end."""

    def stop(done, hist):
        if done == at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fb.fed_fit(model, data, algorithm, checkpoint=path, checkpoint_every=at, chunk_size=at, callback=stop, **kw)
    return fb.resume(path, model=model, data=data, algorithm=algorithm)
