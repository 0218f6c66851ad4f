"""The test suite; its folders mirror the package (``make test``; markers in pytest.ini)."""
