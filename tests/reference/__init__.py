"""Reference re-implementations of the authors' decoding loops (issue 21), written from reading
their code or, where it is not public, the paper's algorithm; each test runs one against selfspec's
``*_paper`` configuration and compares outputs and per-step traces."""
