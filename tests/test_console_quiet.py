"""Console output: the expected library notices are silenced where they arise, real warnings stay, and the
lifecycle's summary says where the plots are."""

from __future__ import annotations

import logging
import warnings

import torch

from moe_core.quiet import MLFLOW_TRANSFORMERS_NOISE, quiet_loggers, quiet_tracer_warnings


def test_quiet_loggers_is_scoped(caplog, monkeypatch):
    # importing mlflow (any earlier test may have) stops its loggers propagating to caplog's root handler
    monkeypatch.setattr(logging.getLogger("mlflow"), "propagate", True)
    logger = logging.getLogger("mlflow.transformers")
    logger.setLevel(logging.NOTSET)
    with caplog.at_level(logging.WARNING):
        with quiet_loggers(*MLFLOW_TRANSFORMERS_NOISE):
            logger.warning("The model card could not be retrieved from the hub")
            logging.getLogger("moe_core.train").warning("a real warning")
        logger.warning("after the call")
        with quiet_loggers("DeepSpeed"):
            created = logging.getLogger("DeepSpeed")
            created.setLevel(logging.WARNING)  # what DeepSpeed does when it is imported inside the block
            created.warning("Setting accelerator to CPU")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["a real warning", "after the call"]
    assert logger.level == logging.NOTSET and not logger.filters


def test_tracer_warnings_silenced_only_inside():
    def branchy(x):
        return x * 2 if bool(x.sum() > 0) else x  # a Python branch on a tensor: the tracer warns

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_tracer_warnings():
            torch.jit.trace(branchy, torch.ones(2))
            warnings.warn("a real warning", UserWarning, stacklevel=1)
        torch.jit.trace(branchy, torch.ones(2))
    kinds = [w.category.__name__ for w in caught]
    assert kinds.count("UserWarning") == 1 and kinds.count("TracerWarning") >= 1
    assert kinds.index("UserWarning") < kinds.index("TracerWarning")  # the one inside the block was dropped


def test_summary_names_plots_and_dashboard(tmp_path, capsys):
    from flows.cli import _print_where_to_look

    (tmp_path / "analysis" / "plots").mkdir(parents=True)
    _print_where_to_look("lifecycle", {"out_dir": str(tmp_path)}, {"prefect": "ephemeral", "home": "/h"})
    out = capsys.readouterr().out
    assert f"plots             {tmp_path / 'analysis' / 'plots'}" in out
    assert "moe-lab dashboard --runs /h/runs" in out
