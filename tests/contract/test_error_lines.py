"""A named error is one line whatever text it quotes: a pickle's, a file's name, a server's reply."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stagerd.contract.adopt.dcp_metadata import parse_dcp_metadata
from stagerd.errors import DcpFormatError, HeaderError, SinkError


@given(message=st.text(), path=st.none() | st.text(min_size=1))
def test_any_message_and_path_print_as_one_line_that_keeps_printable_text_as_it_is(message, path):
    text = str(HeaderError(message, path=path))
    assert text.isprintable() and len(text.splitlines()) <= 1
    if message.isprintable():
        assert text.endswith(message)


@pytest.mark.parametrize("pickle", [b"F nan\n.", b"F 1\r\x1b[2J\n."])
def test_an_unpickler_message_quoting_the_pickle_is_one_line(pickle):
    """Before: `could not convert string to float: ' nan` and `'` on two lines of `stagerd` and `status`,
    and a pickle's ESC sequence reached the terminal as it was."""
    with pytest.raises(DcpFormatError) as e:
        parse_dcp_metadata(pickle, "ckpt/.metadata")
    assert len(str(e.value).splitlines()) == 1 and "\x1b" not in str(e.value)


def test_a_servers_reply_with_line_breaks_is_one_line():
    e = SinkError("AccessDenied: <Error>\n  <Message>no</Message>\r\n</Error>\u2028", path="s3://b/p")
    assert str(e) == "s3://b/p: AccessDenied: <Error>\\n  <Message>no</Message>\\r\\n</Error>\\u2028"
