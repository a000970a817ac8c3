def generate(*a, **k):
    raise NotImplementedError
def stream_generate(*a, **k):
    raise NotImplementedError
