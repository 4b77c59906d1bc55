"""Raw record parsing and normalization (unit)."""

from __future__ import annotations

import datetime as dt
import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.lib import records
from tasks.lib.errors import StepError


def line(**fields: object) -> bytes:
    record = {"id": "1", "text": "hello world", "source": "t", "created_at": "2026-11-01T00:00:00+00:00"}
    record.update(fields)
    return json.dumps(record).encode()


def parse(data: bytes, max_bytes: int = 1_000_000) -> list[dict[str, object]]:
    return list(records.parse_lines("raw/part.jsonl", data, max_bytes))


def test_parses_records_and_skips_blank_lines() -> None:
    out = parse(line(id="a") + b"\n\n" + line(id="b") + b"\n")
    assert [r["id"] for r in out] == ["a", "b"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (line() + b"\n" + b'{"id": "2", "text": "caf\xe9"}', "raw/part.jsonl:2: invalid UTF-8"),
        (line() + b"\n{not json\n", "raw/part.jsonl:2: invalid JSON"),
        (b'{"id": "1", "source": "s", "created_at": "x"}', "raw/part.jsonl:1: record missing 'text'"),
        (b"[1, 2]", "expected a JSON object"),
        (line(text=7), "'text' is int"),
    ],
)
def test_bad_lines_name_file_line_and_problem(data: bytes, message: str) -> None:
    with pytest.raises(StepError, match=message.replace("(", r"\(")):
        parse(data)


def test_oversized_record_is_rejected_before_decoding() -> None:
    huge = line(text="x" * 2_000_000)
    with pytest.raises(StepError, match=r"record of 2\.0 MB exceeds the 1\.0 MB limit"):
        parse(huge)


def test_normalize_strips_controls_unifies_newlines_and_nfc() -> None:
    assert records.normalize_text("  cafe\u0301\r\nline\x00two\x07  \r\n") == "café\nlinetwo"
    assert records.normalize_text("tab\tkept\nnewline kept") == "tab\tkept\nnewline kept"


def test_dedup_keeps_first_and_counts_copies() -> None:
    raw = [
        {"id": "1", "text": "same text", "source": "a", "created_at": "t1"},
        {"id": "2", "text": "same text\r\n", "source": "b", "created_at": "t2"},
        {"id": "3", "text": "other", "source": "c", "created_at": "t3"},
    ]
    result = records.normalize_and_dedup(iter(raw))
    assert result.records_in == 3
    assert [(r["id"], r["copies"]) for r in result.records] == [("1", 2), ("3", 1)]
    assert result.records[0]["content_hash"] == records.content_hash("same text")


def test_interval_days_end_exclusive() -> None:
    days = records.interval_days(dt.date(2026, 11, 22), 3)
    assert days == [dt.date(2026, 11, 19), dt.date(2026, 11, 20), dt.date(2026, 11, 21)]


# --- personal data: scrub (the capture) and EMAIL_RE (validation) ---

@pytest.mark.parametrize(
    "address",
    [
        "ann@example.org",
        "first.last+tag@mail.example.co.uk",
        "jürgen.müller@exämple.de",  # Unicode local part and domain
        "用户@例子.广告",
        "почта@пример.рф",
        "उपयोगकर्ता@उदाहरण.भारत",  # Devanagari: vowel signs are combining marks, not letters
        "jose\u0301@example.com",  # a decomposed accent
        "user@xn--80ak6aa92e.xn--p1ai",  # a domain in its ASCII (punycode) form
        "ich@例え。日本",  # an ideographic full stop (IDNA's)
    ],
)
def test_an_e_mail_address_of_any_script_is_scrubbed_and_validation_counts_it(address: str) -> None:
    assert records.scrub(f"Write to {address} today") == "Write to <email> today"
    assert re.search(records.EMAIL_RE, f"Write to {address} today")  # validation's SQL runs this with re


@pytest.mark.parametrize(
    "text",
    [
        "user@localhost",  # no dot in the domain
        "@example.com",  # no local part
        "a@b.c",  # a one-letter top-level domain
        "x@1.2.3.4",  # digits are no top-level domain
        "see @dataclasses.dataclass(frozen=True) and a@b",
        "me at example dot com",
    ],
)
def test_what_is_no_e_mail_address_stays(text: str) -> None:
    assert records.scrub(text) == text
    assert not re.search(records.EMAIL_RE, text)


def test_validation_uses_the_rule_scrub_uses() -> None:
    from tasks import validate

    assert validate.EMAIL_RE is records.EMAIL_RE


# pieces of addresses: local-part characters (a 63-character run among them), "@" (the fullwidth at sign
# is none), dots, domains
ADDRESS_PIECES = ["a", "b1", "ü", "\u0942", "_", "%", "+", "-", ".", "\u3002", "@", "\uff20", " ", "cc", "a" * 63,
                  "@b.cc", ".xn--p1ai"]


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.sampled_from(ADDRESS_PIECES), max_size=30).map("".join))
def test_scrub_finds_the_addresses_the_whole_pattern_finds(text: str) -> None:
    """scrub searches from each '@' (linear time), then reads the local part backwards: the same
    addresses as a search for EMAIL_RE (a local part of 64 characters at most, from the end of the
    address before it on)."""
    assert records._replace(text, records._email_spans(text), "<email>") == re.sub(records.EMAIL_RE, "<email>", text)


@pytest.mark.parametrize(
    ("text", "scrubbed"),
    [
        ("card 4111 1111 1111 1111 exp", "card <card> exp"),
        ("4111-1111-1111-1111", "<card>"),
        ("4111111111111111", "<card>"),
        ("amex 3782 822463 10005, diners 3056 930902 5904", "amex <card>, diners <card>"),
        ("13 digits: 4222222222222; 19: 6011000000000000001", "13 digits: <card>; 19: <card>"),
        ("4111 1111 1111 1111 003", "<card>"),  # 4-4-4-4-3, 19 digits
        ("4111-1111-1111-1111 12/27 123", "<card> 12/27 123"),  # an expiry date and CVV after it
        ("order 12 4111 1111 1111 1111", "order 12 <card>"),  # a count before it
        ("4111111111111111 5500000000000004 340000000000009", "<card> <card> <card>"),
        ("１２３４ ５６７８ ９０１２ ３４５２", "<card>"),  # fullwidth digits
    ],
)
def test_a_card_number_passing_luhn_is_scrubbed(text: str, scrubbed: str) -> None:
    assert records.scrub(text) == scrubbed


@pytest.mark.parametrize(
    "text",
    [
        "4111 1111 1111 1112",  # fails the Luhn check
        "4111111111111112",
        "1111 2222 3333 4445 is a ticket",
        "4111 1111 1111",  # 12 digits
        "41111111111111110000",  # 20 digits: not a card even though Luhn holds
        "pi is 3.4111111111111111",  # the decimals of a number
        "4111  1111  1111  1111",  # parted by two spaces
    ],
)
def test_a_digit_run_that_is_no_card_number_stays(text: str) -> None:
    assert records.scrub(text) == text


def test_luhn() -> None:
    assert records.luhn_valid("4111111111111111") and records.luhn_valid("378282246310005")
    assert not records.luhn_valid("4111111111111112") and not records.luhn_valid("378282246310006")


@pytest.mark.parametrize(
    "number",
    [
        "+1 415 555 0132",
        "+14155550132",
        "(415) 555-0132",  # national: the default region's (US)
        "415-555-0132",
        "415.555.0132",
        "+1 (415) 555-0132",
        "+44 20 7946 0958",  # international: any country
        "+49 (0)30 1234567",
        "+33 1 23 45 67 89",
        "+81 3-1234-5678",
    ],
)
def test_a_phone_number_is_scrubbed(number: str) -> None:
    assert records.scrub(f"Call {number} today") == "Call <phone> today"


@pytest.mark.parametrize(
    "text",
    [
        "released in 2026, 12 months after 2025",
        "Python 3.11.7 (main, May  9 2026, 07:35:25)",
        "1234567 rows in 1,234,567,890 bytes",
        "x = 0x7fffffff; port 8080; pid 1234567; arr[123456789]",
        "started 2026-11-25 12:00:00, ended 2026-11-25T12:30:00Z",
        "from 192.168.100.200 at t=1732530000",
        "versions 2026 42 3.11.7",  # digits of a valid US number, not grouped as one
        "pages 3-14 (2019)",
    ],
)
def test_numbers_that_are_no_phone_numbers_stay(text: str) -> None:
    assert records.scrub(text) == text


def test_national_numbers_are_those_of_the_region_given() -> None:
    assert records.scrub("call 020 7946 0958", phone_region="GB") == "call <phone>"
    assert records.scrub("call 020 7946 0958") == "call 020 7946 0958"  # not a US number
    assert records.scrub("call (415) 555-0132 or +1 415 555 0132", phone_region=None) == "call (415) 555-0132 or <phone>"


def test_beyond_the_checked_candidates_a_phone_length_is_scrubbed_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "PHONE_CHECKS", 0)
    text = "call +1 415 555 0132, (415) 555-0132 or +44 20 7946 0958; ids 1234567 and 12 34 56 78 90 12"
    assert records.scrub(text) == "call <phone>, <phone> or <phone>; ids 1234567 and 12 34 56 78 90 12"
    assert records.scrub("+12 34 56", phone_region=None) == "+12 34 56"  # under 7 digits: no candidate


def test_every_rule_has_its_placeholder_in_one_text() -> None:
    text = "Mail jürgen.müller@exämple.de, card 4111 1111 1111 1111, call +1 415 555 0132, or (415) 555-0132."
    assert records.scrub(text) == "Mail <email>, card <card>, call <phone>, or <phone>."
    many = " ".join(f"+1 415 555 01{n:02d}" for n in range(40))  # more than PHONE_CHECKS
    assert records.scrub(many) == " ".join(["<phone>"] * 40)


def test_the_phone_library_and_luhn_check_a_bounded_number_of_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear time without a clock: a text full of numbers costs the library PHONE_CHECKS
    calls, a long run of digit groups five Luhn checks."""
    import phonenumbers

    calls = {"matcher": 0, "luhn": 0}
    matcher, luhn = phonenumbers.PhoneNumberMatcher, records.luhn_valid

    def counting_matcher(*args: object, **kwargs: object) -> object:
        calls["matcher"] += 1
        return matcher(*args, **kwargs)

    def counting_luhn(digits: str) -> bool:
        calls["luhn"] += 1
        return luhn(digits)

    monkeypatch.setattr(phonenumbers, "PhoneNumberMatcher", counting_matcher)
    monkeypatch.setattr(records, "luhn_valid", counting_luhn)
    records.scrub("(12) (34) (56) (78) (90) (12) (34), " * 400 + "1111 " * 3000)
    assert calls == {"matcher": records.PHONE_CHECKS, "luhn": 5}  # five candidates fail, the run is left


@pytest.mark.parametrize(
    ("text", "scrubbed"),
    [
        ("a" * 1_000_000 + " x@y.io", "a" * 1_000_000 + " <email>"),  # one long word of e-mail characters
        (("a" * 64 + "@") * 4_000, None),  # local parts, each '@' without a domain
        ("a@" * 128_000, None),
        ("@b.cc" * 50_000, "@<email>" * 25_000),
        ("1" * 256_000, None),  # long digit runs
        ("1 " * 128_000, None),
        ("1111 " * 50_000, None),
        ("+1 " * 85_000, None),  # text full of '+'
        ("(12) " * 50_000, None),
    ],
    ids=["word", "local-parts", "a@", "@domain", "digits", "1-spaced", "groups", "plus", "brackets"],
)
def test_scrubbing_adversarial_text_takes_linear_time(text: str, scrubbed: str | None) -> None:
    """The capture's writer scrubs every captured field (serve.capture.max_field_chars, 16 kB, in
    the server's process): an e-mail pattern with open-ended repeats backtracked quadratically on
    one long word (8 kB: 62 ms; 1 MB: minutes). A megabyte (the rest: 256 kB, minutes if quadratic
    too) takes up to about a second here."""
    started = time.perf_counter()
    assert records.scrub(text) == (text if scrubbed is None else scrubbed)
    assert time.perf_counter() - started < 10  # minutes if quadratic
