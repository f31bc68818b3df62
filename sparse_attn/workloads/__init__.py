"""The prompts and tasks every command runs: one home for what calibrate, eval, the demo and the
benchmarks feed a model (no vLLM, no tokenizer of its own: each builder takes one).

* :mod:`.text`      - the primitives: word lists, filler essays, keyed needles, variable chains, noise,
  insertion at fractional depths.
* :mod:`.synthetic` - the RULER-style calibration generator (``--calib_set synthetic``), with length
  staggering inside each bin.
* :mod:`.tasks`     - the held-out tasks with known answers that ``sparse-attn eval`` scores (and
  ``--calib_set tasks`` calibrates on, from another random stream).
* :mod:`.prompts`   - :class:`~.prompts.CalibrationSample`, the prompt-file format (``--calib_data_dir`` /
  ``--prompts_file``), loading, validation and the one length check.
* :mod:`.lengths`   - the length bins both commands share and the room a task prompt leaves in its bin.

Layering (``tests/sparse_attn/test_import_graph.py``): calibration, evaluation, the demo and the
benchmarks import this package; it imports none of them. Errors are
:class:`sparse_attn.errors.CalibrationDataError`.
"""
