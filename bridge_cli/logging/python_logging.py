"""Python ``logging`` as the logger section asks: level, warning filter, silenced modules.

Megatron-Bridge's behaviour: the level applies to this project's and megatron-core's loggers (every
logger with ``set_level_for_all_loggers``); ``filter_warnings`` drops WARNING records and
``modules_to_filter`` every record of the named loggers, on every logger that exists once
megatron-core is imported (the CLI's own messages are not logging records and always show).
"""

from __future__ import annotations

import logging

OWN_LOGGERS = ("bridge_cli", "megatron")


def configure_python_logging(cfg) -> None:
    """Apply ``cfg`` (the LoggerConfig) to the loggers that exist now."""
    names = [""] + list(logging.root.manager.loggerDict)
    loggers = [logging.getLogger(name) for name in names]
    if cfg.logging_level is not None:
        for name, logger in zip(names, loggers):
            if cfg.set_level_for_all_loggers or name.split(".")[0] in OWN_LOGGERS:
                logger.setLevel(cfg.logging_level)
    silenced = tuple(cfg.modules_to_filter or ())
    if not cfg.filter_warnings and not silenced:
        return

    def keep(record: logging.LogRecord) -> bool:
        if cfg.filter_warnings and record.levelno == logging.WARNING:
            return False
        return not any(record.name == module or record.name.startswith(module + ".") for module in silenced)

    for logger in loggers:
        logger.addFilter(keep)


def show_info_records(name: str) -> None:
    """Print the INFO records of logger ``name`` too (megatron-core logs its straggler and determinism
    reports there), on stderr like its warnings, unless logger.logging_level has set that logger's level."""
    import sys

    logger = logging.getLogger(name)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not any(getattr(handler, "shows_info_records", False) for handler in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)  # formatted as logging's last-resort handler prints warnings
        handler.shows_info_records = True
        logger.addHandler(handler)
