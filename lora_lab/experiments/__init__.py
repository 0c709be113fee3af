"""Code that one notebook uses, a module named after its notebook (``notebooks/NN_<name>.ipynb`` imports
``lora_lab.experiments.<name>``): the longer measurement machinery a notebook calls, kept testable here.

Notebook 01 builds everything it needs in its own cells and has no module here.
"""
