"""Processes and collectives: the ``Comm`` wrapper over ``torch.distributed``
(``comm``), the same-host shared-memory all-reduce and all-gather
(``shm_collectives``), worker groups and torchrun (``launcher``, with this process's own
rank in ``local_worker`` and how failures travel in ``failures``), emulated links
between network namespaces (``emulated_link``)."""
