from experiments.machine import FEATURES, cpu_features, describe


def test_the_cpu_features_are_read_from_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 vaes\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_features(str(info)) == ["avx2", "avx512f", "avx512_bf16"]
    info.write_text("processor\t: 0\n")
    assert cpu_features(str(info)) == [] and cpu_features(str(tmp_path / "absent")) == []


def test_every_figure_names_the_cpu_features():
    out = describe("cpu")
    assert set(out["cpu_features"]) <= set(FEATURES) and out["cpu"]
