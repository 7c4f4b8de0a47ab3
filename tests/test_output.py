import io

from slurmddp.output import PrefixedStream


def test_every_line_gets_the_prefix_once():
    buf = io.StringIO()
    s = PrefixedStream(buf, "[1/4] ")
    s.write("a\nb")
    s.write("c\n")
    s.write("\n")
    s.write("d\n")
    assert buf.getvalue() == "[1/4] a\n[1/4] bc\n[1/4] \n[1/4] d\n"
