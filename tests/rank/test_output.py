import io

from slurmddp.rank.output import PrefixedStream


def test_every_line_gets_the_prefix_once():
    buf = io.StringIO()
    s = PrefixedStream(buf, "[1/4] ")
    s.write("a\nb")
    s.write("c\n")
    s.write("\n")
    s.write("d\n")
    assert buf.getvalue() == "[1/4] a\n[1/4] bc\n[1/4] \n[1/4] d\n"


class Writes(io.StringIO):
    """Records each write: what a pipe shared by two ranks would receive, write by write."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)


def test_a_printed_line_reaches_the_target_in_one_write():
    target = Writes()
    s = PrefixedStream(target, "[1/4] ")
    print("SHOW {}", file=s)  # print writes the text, then the newline
    assert target.calls == ["[1/4] SHOW {}\n"]


def test_a_line_without_its_end_goes_out_at_flush_and_is_not_prefixed_twice():
    target = Writes()
    s = PrefixedStream(target, "[0/2] ")
    s.write("progress 10%")
    s.flush()
    s.write(" 20%\n")
    assert target.calls == ["[0/2] progress 10%", " 20%\n"]
