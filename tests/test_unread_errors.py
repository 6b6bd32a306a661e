"""asyncio's 'Future exception was never retrieved' lines for errors the command has already
said once: dropped by the filter `start_logging` puts on the `asyncio` logger; any other
unread error still logs (a bug must not go quiet)."""

from __future__ import annotations

import asyncio
import gc
import logging
import ssl

import pytest
from aiokafka.errors import KafkaConnectionError

from collector.transport.kafka import UnreadKafkaErrors


def _free_unread(exc: BaseException) -> None:
    """A future that failed with `exc` and is freed without anyone reading it, as the stream
    of a TLS connection the broker closed is when it is collected in one cycle with its
    reader: asyncio logs it from the future's finaliser."""

    async def fail() -> None:
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(exc)
        del fut
        gc.collect()

    asyncio.run(fail())


@pytest.mark.parametrize(
    ("exc", "logged"),
    [
        (ssl.SSLError(1, "[SSL: SSLV3_ALERT_CERTIFICATE_UNKNOWN] sslv3 alert"), False),
        (KafkaConnectionError("Connection at 127.0.0.1:19095 closed"), False),
        (ValueError("a bug"), True),
        (ConnectionResetError(104, "reset"), True),
    ],
)
def test_unread_copies_of_said_errors_are_dropped(
    exc: BaseException, logged: bool, caplog: pytest.LogCaptureFixture
) -> None:
    log = logging.getLogger("asyncio")
    drop = UnreadKafkaErrors()
    log.addFilter(drop)
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            _free_unread(exc)
    finally:
        log.removeFilter(drop)
    unread = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len(unread) == (1 if logged else 0), caplog.text
    if logged:
        assert unread[0].exc_info is not None and unread[0].exc_info[1] is exc


def test_without_the_filter_asyncio_logs_the_tls_error(caplog: pytest.LogCaptureFixture) -> None:
    """The line the filter exists for, as asyncio writes it."""
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _free_unread(ssl.SSLError(1, "sslv3 alert certificate unknown"))
    assert [r.getMessage().splitlines()[0] for r in caplog.records] == [
        "Future exception was never retrieved"
    ]
