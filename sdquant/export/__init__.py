"""Writers: the .sd2 package, ONNX, Hugging Face GPTQ/AWQ checkpoints, torch.compile lowering. Calling this
package, ``sdquant.export(result, path, format=...)``, runs ``sdquant.api.export``."""
from sdquant._callable import make_callable

make_callable(__name__, "export")
