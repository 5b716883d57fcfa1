class FluxAccelError(RuntimeError):
    """An error the user can act on: the message says what is wrong and what to do.

    ComfyUI shows the exception text in the UI, so every message names the fix
    (another node setting, a launch flag, a package to install). ComfyUI reports an execution error's type as the
    class's module and name (execution.full_type_name); the module would be the plugin's folder as ComfyUI imported
    it (a path that differs between installs), so each of these classes names a short, stable module instead, e.g.
    `fluxaccel.FluxAccelError`. Pickling finds the class again by name (_rebuild)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _named(cls)

    def __reduce__(self):
        return _rebuild, (type(self).__qualname__, self.args)


_CLASSES: dict[str, type] = {}


def _named(cls: type) -> None:
    _CLASSES[cls.__qualname__] = cls
    cls.__module__ = "fluxaccel"


def _rebuild(name: str, args: tuple):
    return _CLASSES[name](*args)


_named(FluxAccelError)
