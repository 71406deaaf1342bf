"""Tooling on top of the library, never imported by it: the CLI, ahead-of-time compilation and SASS
reading, the CPU execution of the Gluon kernel (``gluon_cpu``), the accuracy studies and their
input families, the benchmark."""
