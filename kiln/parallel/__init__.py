"""How the model is spread over processes: one strategy class per way, behind one small interface.

Depends on torch, kiln.state and kiln.optim only; a strategy never imports the facade or the compile
package.
"""

from kiln.parallel.base import SingleProcess, Strategy
from kiln.parallel.ddp import DDPStrategy

__all__ = ["DDPStrategy", "SingleProcess", "Strategy"]
