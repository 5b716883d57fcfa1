class FluxAccelError(RuntimeError):
    """An error the user can act on: the message says what is wrong and what to do.

    ComfyUI shows the exception text in the UI, so every message names the fix
    (another node setting, a launch flag, a package to install).
    """
