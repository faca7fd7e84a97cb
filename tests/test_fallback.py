"""nvfp4_dit.fallback: one warning per reason, pointing at the caller's line."""

import logging
import warnings

import torch

import nvfp4_dit
from nvfp4_dit.fallback import FallbackWarning, warn_once


def test_the_op_warns_once_at_the_callers_line():
    q = torch.randn(1, 128, 2, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            nvfp4_dit.attention(q, q, q)  # auto on a CPU: exact attention, one warning
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1
    assert fallbacks[0].filename == __file__, fallbacks[0].filename  # not torch's custom-op machinery
    nvfp4_dit.reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nvfp4_dit.attention(q, q, q)
    assert len(caught) == 1


def test_a_logger_gets_the_message_once(caplog):
    log = logging.getLogger("nvfp4_dit.test")
    with caplog.at_level(logging.WARNING, logger="nvfp4_dit.test"), warnings.catch_warnings():
        warnings.simplefilter("error")  # a logged report is not also a Python warning
        for _ in range(3):
            warn_once("nvfp4_dit: a test reason", logger=log)
    assert [r.getMessage() for r in caplog.records] == ["nvfp4_dit: a test reason"]
