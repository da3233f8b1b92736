"""CPU tests of install.py, the two commands' set-up."""


def test_install_names_what_is_missing_or_too_old_and_keeps_an_installed_torch(tmp_path, monkeypatch):
    """install.py (the two commands' set-up) installs the lines of a requirements file that no installed package
    satisfies; an installed torch counts whatever its version. Here, after it ran, every file is satisfied."""
    import install
    assert not [f for f in ("requirements.txt", "requirements-data.txt", "requirements-test.txt") if install.missing(f)]
    monkeypatch.setattr(install, "HERE", str(tmp_path))
    (tmp_path / "r.txt").write_text("# a comment\ntorch==0.0.1\nnumpy>=1.0  # new enough\nnumpy>=999\n\n"
                                    "pytest==0.1\nno-such-package-dflash==1.0\n")
    assert install.missing("r.txt") == ["numpy>=999", "pytest==0.1", "no-such-package-dflash==1.0"]
