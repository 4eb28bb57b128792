"""logger.logging_level, filter_warnings, modules_to_filter and set_level_for_all_loggers act on Python logging."""

from __future__ import annotations

import logging

import pytest

from bridge_cli.config.logger_config import LoggerConfig
from bridge_cli.logging.python_logging import configure_python_logging


@pytest.fixture(autouse=True)
def restore_loggers():
    """configure_python_logging acts on every logger of the process: undo it for the other tests."""
    names = [""] + list(logging.root.manager.loggerDict)
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).filters)) for name in names}
    yield
    for name in [""] + list(logging.root.manager.loggerDict):
        logger = logging.getLogger(name)
        logger.level, logger.filters = saved.get(name, (logging.NOTSET, []))


def records_kept(cfg: LoggerConfig, caplog, emit) -> list[str]:
    for name in ("megatron.core.test_a", "megatron.core.test_b", "otherlib.test"):
        logging.getLogger(name)  # the loggers exist before configuration, as megatron-core's do
    configure_python_logging(cfg)
    with caplog.at_level(logging.DEBUG):
        caplog.clear()
        emit()
    return [f"{r.name}:{r.levelname}" for r in caplog.records]


def test_warnings_and_named_modules_are_dropped(caplog):
    cfg = LoggerConfig(filter_warnings=True, modules_to_filter=["megatron.core.test_b"])

    def emit():
        logging.getLogger("megatron.core.test_a").warning("dropped")
        logging.getLogger("megatron.core.test_a").error("kept")
        logging.getLogger("megatron.core.test_b").error("dropped too")

    assert records_kept(cfg, caplog, emit) == ["megatron.core.test_a:ERROR"]


def test_level_applies_to_own_loggers_unless_all_are_asked_for():
    logging.getLogger("otherlib.test").setLevel(logging.NOTSET)
    configure_python_logging(LoggerConfig(logging_level=logging.ERROR, filter_warnings=False))
    assert logging.getLogger("megatron.core.test_a").level == logging.ERROR
    assert logging.getLogger("otherlib.test").level == logging.NOTSET
    configure_python_logging(LoggerConfig(logging_level=logging.ERROR, filter_warnings=False,
                                          set_level_for_all_loggers=True))
    assert logging.getLogger("otherlib.test").level == logging.ERROR
